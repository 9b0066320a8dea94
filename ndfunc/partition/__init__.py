"""The SPMD partitioner behind `nf.jit`.

    strategies   candidate (input layouts -> output layouts) per node, from DTensor's rules
    redistribute the collectives between two layouts, and what they cost
    solve        one strategy per node, chosen for the whole graph by bytes moved and work
    lower        the local program: aten ops on blocks and functional collectives
    program      the object transforms work on; analysis reads it (text, costs)
"""
