"""Edit requests whose answers mostly repeat a given text (benchmarks.prediction, benchmarks.draft_replay): a
spelling fix, a tense change, a verbatim repeat, a rename, ... of a paragraph, a letter or some code (EDITS); a
function renamed in a file of its own, the whole file given back (RENAMES)."""

CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\n"
        "def spread(values):\n    low, high = min(values), max(values)\n    return high - low\n")
CLASS = ("import json\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n        self.data = {}\n\n"
         "    def load(self):\n        with open(self.path) as f:\n            self.data = json.load(f)\n        return self.data\n\n"
         "    def get(self, key, default=None):\n        return self.data.get(key, default)\n\n"
         "    def save(self):\n        with open(self.path, 'w') as f:\n            json.dump(self.data, f, indent=2)\n")
RIVER = ("The river flows through the old town, past the mill and the church, and under the stone bridge where children "
         "fish on summer evenings. In winter the water freezes at the edges, and the ducks gather near the warm outlet of "
         "the bakery. Every spring the town holds a market on the river bank, with bread, cheese, honey and flowers.")
LETTER = ("Dear Anna,\n\nThank you for your letter. We arrived in Lisbon on Tuesday and the weather has been wonderful. "
          "The hotel is small but clean, and the staff are very kind. Tomorrow we will visit the castle and the old "
          "cathedral, and on Friday we take the train to Porto.\n\nWith love,\nMaria\n")
# (what the user asks, the text it is about): edits whose answer mostly repeats the text; a `prediction` is the text as
# the user sent it (a client knows the file it asks to change, not the answer)
EDITS = [
    ("Fix the spelling mistakes in the user's text. Output only the corrected text.",
     RIVER.replace("church", "chruch").replace("bakery", "bakry")),
    ("Fix the spelling mistakes in the user's text. Output only the corrected text.",
     LETTER.replace("weather", "wether").replace("cathedral", "cathedrall")),
    ("Rewrite the text in the past tense.", RIVER),
    ("Repeat the user's text word for word.", RIVER),
    ("Repeat the user's text word for word.", LETTER),
    ("Repeat the user's code exactly.", CODE),
    ("Repeat the user's code exactly.", CLASS),
    ("Output the user's code with the function `mean` renamed to `average`. Output only the code.", CODE),
    ("Add a docstring to each method of this class. Output the whole code.", CLASS),
    ("Change the indent in save() from 2 to 4. Output the whole file.", CLASS),
    ("Change the city Porto to Faro in this letter and output the letter.", LETTER),
    ("Make this letter more formal.", LETTER),
]

# functions renamed in RENAMES, each in a file of its own
NAMES = ["compute_total", "load_rows", "parse_line", "mean", "scale", "merge_maps"]


def renames() -> list[tuple[str, str, str]]:
    """(what the user asks, the file as sent, the answer a model that does it right writes) for each of NAMES: a
    Python file whose one function, used 6 times in it, is renamed everywhere -- the issue's edit workload, each
    request a rename of its own."""
    out = []
    for k, name in enumerate(NAMES):
        body = (f"import math\n\n\ndef {name}(values, factor=1.0):\n    \"\"\"Return the {name} of values.\"\"\"\n"
                f"    result = 0.0\n    for v in values:\n        result += v * factor\n    return result\n\n\n"
                f"def report(rows):\n    out = []\n    for row in rows:\n        out.append({name}(row))\n"
                f"        out.append({name}(row, 2.0))\n    return out\n\n\n"
                f"def check():\n    assert {name}([1, 2]) == 3.0\n    assert {name}([], 5) == 0.0\n    print({name}.__name__)\n")
        new = name + "_v2" if k % 2 else "new_" + name
        out.append((f"Rename the function `{name}` to `{new}`. Output the whole file.", body, body.replace(name, new)))
    return out


# (what the user asks, the file): renames() as EDITS are
RENAMES = [(ask, body) for ask, body, _ in renames()]
