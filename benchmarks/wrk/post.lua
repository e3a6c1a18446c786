-- wrk script: POST the JSON body read from the file named by the first script argument on every
-- request, and print one machine-readable summary line ("WRK_JSON {...}") when the run ends.
--
--   wrk -t1 -c64 -d3s -s benchmarks/wrk/post.lua http://127.0.0.1:24001/v1/chat/completions -- body.json
--
-- `python -m benchmarks.overhead --write-bodies DIR` writes the small and large bodies it uses.

init = function(args)
   local path = args[1]
   if path == nil then
      error("usage: wrk ... -s post.lua URL -- BODY.json")
   end
   local f = assert(io.open(path, "rb"))
   wrk.body = f:read("*a")
   f:close()
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
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
