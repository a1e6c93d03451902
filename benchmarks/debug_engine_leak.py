"""GPU diagnostic: which CUDA tensors survive Engine.shutdown()."""

import gc

import torch

import srt

base = torch.cuda.memory_allocated()
kw = dict(
    device="cuda",
    dtype="float32",
    max_total_tokens=2**20,
    cuda_graph_max_bs=8,
    skip_tokenizer_init=True,
)
for graph in (True, False):
    eng = srt.Engine(cuda_graph=graph, **kw)
    eng.generate(input_ids=[[5, 6, 7]] * 5, sampling_params={"max_new_tokens": 3})
    eng.shutdown()
    del eng
    gc.collect()
    print(f"graph={graph}: leaked {(torch.cuda.memory_allocated() - base) / 2**20:.1f} MiB")
    big = [
        o
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().nbytes() > 2**20
    ]
    for t in big[:10]:
        print("  ", tuple(t.shape), t.dtype, t.untyped_storage().nbytes() // 2**20, "MiB")
        for r in gc.get_referrers(t)[:3]:
            print("     referrer:", type(r).__name__, str(r)[:150].replace("\n", " "))
