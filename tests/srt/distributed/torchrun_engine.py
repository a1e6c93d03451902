"""Launched by torchrun in a test: every rank builds Engine(tp_size=WORLD_SIZE) and generates
the same greedy requests; rank 0 writes the output ids as JSON to argv[1]."""

import json
import os
import sys

import srt

if __name__ == "__main__":
    tp = int(os.environ["WORLD_SIZE"])
    engine = srt.Engine(
        device="cpu", dtype="float32", tp_size=tp, skip_tokenizer_init=True, max_total_tokens=512
    )
    outs = engine.generate(
        input_ids=[[5, 6, 7], [9] * 33, [3]],
        sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    )
    engine.shutdown()
    if os.environ["RANK"] == "0":
        with open(sys.argv[1], "w") as f:
            json.dump([o["output_ids"] for o in outs], f)
