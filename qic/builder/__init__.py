"""`qic build`: stage 1 shard, stage 2 compile, stage 3 bundle."""
