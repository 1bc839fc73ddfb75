"""The serving engines end to end: decode throughput (dense, WISE, speculative arms, defaults), prefill
throughput, prefix caching, draft kinds, tensor-parallel scaling, checkpoint loading, long prompts."""
