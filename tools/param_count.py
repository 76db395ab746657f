#!/usr/bin/env python
"""Print one JSON line with the total and active parameter counts of a model config.

    python tools/param_count.py model=k3 [model.KEY=VALUE ...] [--human]

`active` is the number of parameters touched per token (routed experts at top_k/num_experts, the input
embedding excluded, as in the published 104B figure). The counts come from the model built on the meta
device, not from a formula. With model.vision.enabled=true the vision tower and projector are `breakdown` entries
of their own (`vision_tower`, `mm_projector`), in `total` and in `active` (an image token goes through all of them).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.config import ConfigError, load_model_config  # noqa: E402
from megatron_k3.planning.params import count_parameters  # noqa: E402


def main(argv):
    name, overrides, human = "k3_tiny", [], False
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        if a == "--human":
            human = True
        elif a.startswith("model="):
            name = a.split("=", 1)[1]
        elif "=" in a:
            overrides.append(a)
        else:
            print(f"param_count: unexpected argument {a!r}; use model=NAME and model.KEY=VALUE", file=sys.stderr)
            return 2
    try:
        cfg = load_model_config(name, overrides)
    except ConfigError as e:
        print(f"param_count: {e}", file=sys.stderr)
        return 2
    out = count_parameters(cfg)
    if human:
        out["total_h"] = f"{out['total'] / 1e12:.4f}T" if out["total"] >= 1e12 else f"{out['total'] / 1e9:.3f}B"
        out["active_h"] = f"{out['active'] / 1e9:.2f}B"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
