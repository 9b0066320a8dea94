"""`python -m ndfunc.plan`: the planner's command line (`ndfunc._src.planner.cli`)."""

from ndfunc._src.planner.cli import main

main()
