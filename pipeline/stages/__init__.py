"""Pipeline stages, one module each: data, traces, labels, train, eval, upload (run as `python -m pipeline.stages.<stage>`)."""
