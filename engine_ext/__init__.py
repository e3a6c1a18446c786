"""agentgw's vLLM plugin: host and Mooncake KV offload tiers, soft pins, a control API."""
