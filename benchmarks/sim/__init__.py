"""Offline cluster simulator for agentic traffic: traces -> the real routing core -> modeled
vLLM engines, in virtual time.

- :mod:`benchmarks.sim.traces`: Weka/AgentX and Mooncake loaders, AgentX-shaped generator.
- :mod:`benchmarks.sim.engine`: the engine model (scheduler, KV cache, KV events, pass time).
- :mod:`benchmarks.sim.calibration`: named engine models (Dynamo mocker, H200).
- :mod:`benchmarks.sim.cluster`: the event loop and the gateway model around the real router.
- :mod:`benchmarks.sim.tiers`: host tier per engine + shared store, on-demand loads.
- :mod:`benchmarks.sim.migrations`: the real inter-turn planner and its executor (prefetch, pins).
- :mod:`benchmarks.sim.metrics`: TTFT, prefix reuse vs ideal, interactivity, TPGS.
- :mod:`benchmarks.sim.scale`: scaled-down traces for a fidelity check on tiny CPU engines.

``python -m benchmarks.compare`` runs the policy comparison.
"""
