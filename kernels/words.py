"""The control block's word layout (``dmi.kernels.capture``'s module doc draws it), shared by the
Triton kernels, the ring that writes the words and the traced captures that read them; imports
nothing (compiled model code reads it on machines without Triton)."""
G_ARMED, G_STEP, G_BATCH, G_SEQ, G_END_SEQ, G_PAD_START, G_BASE, G_FIRST_SEQ, G_TRACED, G_KEYS = range(10)
G_WORDS = 10
S_OFFSET, S_SEQ, S_ROWS, S_ROWS_START, S_ENABLED, S_INV = range(6)
S_WORDS = 6
TRACED_WORDS = 3       # a traced site's row in the end kernel's table: site index, site word, row bytes
OFF, ENABLED, ENABLED_ARANGE = 0, 1, 2     # a site's enabled word
SCRATCH_BYTES = 4 << 20   # past the payload ring's end: where traced captures put rows they do not keep
