"""A scripted job with the Python API.

    launch/mpirun -np 2 python examples/api_example.py [MODEL]

With no MODEL, the built-in random MoE (its text is noise).
"""

import sys

import mlxdist

model = sys.argv[1] if len(sys.argv) > 1 else None
with mlxdist.init() as cluster:  # ranks other than 0 serve inside init() and exit at the end
    cluster.load(model, mode="collective", stats=True)  # stats: count routed slots per expert

    result = cluster.generate("Explain MoE routing.", max_tokens=24, temp=0.0)
    print(result.text)
    print(f"{result.stats['generation_tps']:.1f} tok/s, peak GB per rank {result.stats['peak_memory_gb']}")

    for piece in cluster.stream_generate(messages=[{"role": "user", "content": "Hello"}], max_tokens=16):
        print(piece.text, end="", flush=True)
    print()

    results = cluster.generate_batch(["One", "Two", "Three"], max_tokens=16)
    print(f"batch of {len(results)}: {[len(r.tokens) for r in results]} tokens")

    for rank in cluster.stats():
        print(f"rank {rank['rank']}: {rank['slots_local']} slots computed, "
              f"{rank['bytes_sent'] / 1e6:.2f} MB sent")
