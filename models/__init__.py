"""Reference models and entry points, written against ndfunc's public API only."""
