"""The SPMD partitioner behind `nf.jit`.

    strategies   candidate (input layouts -> output layouts) per node, from DTensor's rules
    redistribute the collectives between two layouts, and what they cost
    solve        one strategy per node, chosen for the whole graph by bytes moved and work
    flops        the work of a node, for the cost model and the analysis
    lower        the local program: aten ops on blocks and functional collectives
    bucket       all-reduces that can run together become one
    buffers      which memory each value lives in, and until when (for the passes below)
    inplace      dying buffers reused in place; donated inputs updated where they lie
    program      the object transforms work on; analysis reads it (text, costs)
"""
