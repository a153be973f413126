"""Integer-programming planners: a solver-neutral program and its backends."""
