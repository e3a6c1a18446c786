.PHONY: install bench-setup run test lint bench

install:
	./scripts/setup.sh --test

run:
	./scripts/run.sh

test:
	./scripts/test.sh

lint:
	.venv/bin/ruff check gateway engine_ext kernels benchmarks tests
	.venv/bin/ruff format --check gateway engine_ext kernels benchmarks tests
	.venv/bin/mypy

bench-setup:
	./scripts/bench-setup.sh

bench: install bench-setup
	.venv/bin/python -m benchmarks.overhead
	.venv/bin/python -m benchmarks.routing_cost
	.venv/bin/python -m benchmarks.compare
