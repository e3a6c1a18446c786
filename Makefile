.PHONY: install bench-setup run test test-fast lint bench

install:
	./scripts/setup.sh --test

run:
	./scripts/run.sh

test:
	./scripts/test.sh

test-fast:
	./scripts/test.sh --fast

lint:
	.venv/bin/ruff check gateway engine_ext kernels benchmarks tests testing deploy scripts
	.venv/bin/ruff format --check gateway engine_ext kernels benchmarks tests testing deploy scripts
	.venv/bin/mypy

bench-setup:
	./scripts/bench-setup.sh

bench: install bench-setup
	.venv/bin/python -m benchmarks.overhead
	.venv/bin/python -m benchmarks.routing_cost
	.venv/bin/python -m benchmarks.compare
