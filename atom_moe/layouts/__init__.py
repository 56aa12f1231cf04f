"""Weight layouts, each tagged on the tensor that holds it: gate/up row order (gate_up),
MXFP4 repacked for a16w4's mma fragments (mx_tiles) and for a8w4's fp8 dots (mx_quads)."""
