"""Offline cluster simulator for agentic traffic: traces -> the real routing core -> modeled
vLLM engines, in virtual time.

- :mod:`gateway.sim.traces`: Weka/AgentX and Mooncake loaders, AgentX-shaped generator.
- :mod:`gateway.sim.engine`: the engine model (scheduler, KV cache, KV events, pass time).
- :mod:`gateway.sim.calibration`: named engine models (Dynamo mocker, H200).
- :mod:`gateway.sim.cluster`: the event loop and the gateway model around the real router.
- :mod:`gateway.sim.tiers`: host tier per engine + shared store, on-demand loads.
- :mod:`gateway.sim.migrations`: the real inter-turn planner and its executor (prefetch, pins).
- :mod:`gateway.sim.metrics`: TTFT, prefix reuse vs ideal, interactivity, TPGS.
- :mod:`gateway.sim.scale`: scaled-down traces for a fidelity check on tiny CPU engines.

``python -m benchmarks.compare`` runs the policy comparison.
"""
