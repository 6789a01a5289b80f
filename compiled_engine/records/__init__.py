"""Records that cross stages (request, scheduler output, runner output, engine-core output) and the
runner seam. Every other package may import these; they import only `compiled_engine.sampling_params`."""
