"""`nf.processes`: a notebook as the single controller of real ranks (`controller`), the handles it
holds (`handles`), what crosses the wire (`wire`), and the workers (`worker`, `launch`: Monarch)."""
