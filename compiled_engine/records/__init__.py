"""Records that cross stages (request, scheduler output, runner output, engine-core output) and the
runner seam; every other package may import these, and these import none of them."""
