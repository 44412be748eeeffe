"""The read API: runs, ranks, events, chart series, advice, one run's documents."""
