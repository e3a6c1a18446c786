"""What the tests and the benchmarks both run beside the gateway, and the product never does: the
stand-in engine (:mod:`testing.fake_engine`), a loopback relay that watches a client
(:mod:`testing.loopback_proxy`), gateway replicas behind a real nginx (:mod:`testing.replicas`)
and the network helpers they share (:mod:`testing.net`). ``tests/`` and ``benchmarks/`` import
it; ``gateway/`` never does."""
