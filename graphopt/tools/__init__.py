"""Tools around the optimizer: the CLI, benchmarks, calibration, measurement, sweep, fuzzing, bisection, memory tracing."""
