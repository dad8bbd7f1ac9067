"""policyzoo's benchmarks: the device sweep (`python -m benchmarks.sweep`), its probes, the end-to-end
`generate` timing, the gate benchmark, the pytest-benchmark suites and the LATEST.md generator."""
