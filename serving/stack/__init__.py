"""Running the stack: one service process (`pddjax serve`), the whole stack (`pddjax up`), the A -> B link."""
