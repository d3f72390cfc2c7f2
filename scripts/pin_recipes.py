"""Re-pin recipes in tests/train/recipe_values.json: each named recipe's entry becomes its resolved values now.

    .venv/bin/python scripts/pin_recipes.py configs/d2cse-sup-roberta-base.yaml [more recipes ...]

Run it after a deliberate change to a recipe (and only for the recipes you changed): the entry is replaced by
``load_config(recipe).to_dict()``, so keys added to TrainConfig since the last pin are pinned too. Other entries
are left as they are. Review the diff: it is what ``tests/train/test_recipes.py`` will hold the recipe to.
"""
import json
import sys
from pathlib import Path

from fastprompt.train import load_config

PINS = Path(__file__).resolve().parents[1] / "tests" / "train" / "recipe_values.json"


def main(paths: list[str], pins: Path = PINS) -> int:
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    pinned = json.loads(pins.read_text(encoding="utf-8"))
    for path in map(Path, paths):
        pinned[path.name] = load_config(path).to_dict()
        print(f"pinned {path.name}")
    pins.write_text(json.dumps(dict(sorted(pinned.items())), indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
