"""DistributedOptimizer over the local fp32 main shards, the one global grad-norm rule (plain and
tensor-parallel) and clipping."""
