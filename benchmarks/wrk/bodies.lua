-- wrk script: POST a rotating list of JSON bodies, each with its own headers, and print the same
-- "WRK_JSON {...}" summary as post.lua when the run ends.
--
--   wrk -t1 -c64 -d3s -s benchmarks/wrk/bodies.lua http://127.0.0.1:24001/v1/chat/completions -- DIR/index.txt
--
-- index.txt: one request a line, "BODY_PATH SESSION_ID" (SESSION_ID "-" for none); the body goes
-- out with Content-Type: application/json and, when given, x-agent-session-id. Requests are sent
-- in the file's order (one wrk thread: the connections share the sequence), wrapping around.
-- `python -m benchmarks.overhead --write-bodies DIR` writes the agentic bodies and their index.
--
-- With two more arguments, MARK and BASE (the "turns" case): each body holds MARK once, and every
-- pass through the list is new: pass p (from BASE) writes p over MARK (zero-padded to its length)
-- and appends "-p" to the session id, so each request is a conversation turn no earlier pass sent.

local reqs = {}
local heads, tails, sids = {}, {}, {}
local n = 0
local i = 0
local fresh = false
local width = 0
local base = 0

init = function(args)
   local index = args[1]
   if index == nil then
      error("usage: wrk ... -s bodies.lua URL -- index.txt [MARK BASE]")
   end
   local mark = args[2]
   if mark ~= nil then
      fresh = true
      width = #mark
      base = tonumber(args[3] or "0")
   end
   for line in io.lines(index) do
      local path, sid = line:match("^(%S+)%s+(%S+)$")
      if path ~= nil then
         local f = assert(io.open(path, "rb"))
         local body = f:read("*a")
         f:close()
         local headers = {["Content-Type"] = "application/json"}
         if sid ~= "-" then
            headers["x-agent-session-id"] = sid
         end
         n = n + 1
         if fresh then
            local a, b = body:find(mark, 1, true)
            if a == nil then
               error(path .. " does not hold the mark " .. mark)
            end
            heads[n] = body:sub(1, a - 1)
            tails[n] = body:sub(b + 1)
            sids[n] = sid
         else
            reqs[n] = wrk.format("POST", nil, headers, body)
         end
      end
   end
   if n == 0 then
      error("no requests in " .. index)
   end
end

local sent = 0

request = function()
   i = i % n + 1
   if not fresh then
      return reqs[i]
   end
   local pass = base + math.floor(sent / n)
   sent = sent + 1
   local tag = string.format("%0" .. width .. "d", pass)
   local headers = {["Content-Type"] = "application/json"}
   if sids[i] ~= "-" then
      headers["x-agent-session-id"] = sids[i] .. "-p" .. pass
   end
   return wrk.format("POST", nil, headers, heads[i] .. tag .. tails[i])
end

done = function(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"mean_us":%.1f,"p50_us":%d,"p90_us":%d,' ..
      '"p99_us":%d,"max_us":%d,"err_connect":%d,"err_read":%d,"err_write":%d,"err_status":%d,' ..
      '"err_timeout":%d}\n',
      summary.requests, summary.duration, summary.bytes, latency.mean,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
      e.connect, e.read, e.write, e.status, e.timeout))
end
