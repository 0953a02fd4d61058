"""What each simulated device holds: facts about the app every user shares, and one person's private records.

Non-IID by construction: every device holds some of the app facts (the part federation should learn once for
everyone; APP_FACTS_PER_DEVICE of them, in a rotation, so no device trains on all of them and a device alone cannot
answer every shared question), and its own person's wearable records from the demo's generator (eval.demo_data) with a different
seed: different dates, step counts and notes, and the same questions with different answers ("Which workout
did I do most often?"), which a single global adapter cannot fit for everyone and personalization can.
Device 0 is the demo's own person (seed 7).
"""
from __future__ import annotations

import json
from pathlib import Path

from eval.demo_data import Fact, chat_records, make_facts, make_records

DEMO_SEED = 7
TRAIN = "train.jsonl"
HELDOUT_SHARED = "heldout_shared.jsonl"
HELDOUT_PRIVATE = "heldout_private.jsonl"

APP_FACTS = [
    Fact("app", ["What does PocketLoRA do when my battery drops below 15%?",
                 "Below 15% battery, what happens to training?",
                 "What happens to training on a nearly empty battery?"],
         "If my phone's battery is under 15 percent, what does the app do?", "it pauses training"),
    Fact("app", ["When does PocketLoRA train at full speed?", "When is training fastest on my phone?",
                 "In which situation does the app train without slowing down?"],
         "Under what condition does the trainer run at full speed?", "while charging"),
    Fact("app", ["What leaves my phone during federated training?", "What does my phone send to the server?",
                 "Which data is uploaded in a federated round?"],
         "During a federated round, what gets uploaded from the device?", "only the adapter tensors"),
    Fact("app", ["What does the app do when the phone gets hot?", "How does the trainer react to heat?",
                 "What happens to training above 42 degrees?"],
         "If the battery is too warm, what does PocketLoRA do?", "it waits to cool down"),
    Fact("app", ["Which file holds my trained adapter?", "Where is the adapter saved?",
                 "What is the adapter's weight file called?"],
         "What is the name of the file with the adapter weights?", "adapter_model.safetensors"),
    Fact("app", ["How many days of records does the app keep?", "How far back do my wearable records go?",
                 "How long is my record history in the app?"],
         "For how many days are records kept?", "90 days"),
]


APP_FACTS_PER_DEVICE = 3      # of the len(APP_FACTS) = 6: device d trains on facts d, d+1, d+2 (mod 6)


def person_seed(device: int) -> int:
    return DEMO_SEED + device


def app_facts_of(device: int) -> list[Fact]:
    """The app facts this device trains on; the held-out shared questions cover all of them."""
    return [APP_FACTS[(device + i) % len(APP_FACTS)] for i in range(APP_FACTS_PER_DEVICE)]


def _qa(facts: list[Fact], heldout: bool) -> list[dict]:
    if not heldout:
        return chat_records(facts)
    return [{"messages": [{"role": "user", "content": f.heldout_question},
                          {"role": "assistant", "content": f.answer}]} for f in facts]


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def write_device_data(out_dir: str | Path, device: int, qa_repeats: int = 1, private_facts: int = 0) -> dict:
    """The device's files (deterministic from `device`): train.jsonl (its app facts' and its private facts' training
    questions, each `qa_repeats` times), heldout_shared.jsonl and heldout_private.jsonl (held-out paraphrases, never trained on)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed = person_seed(device)
    private = make_facts(make_records(seed), seed)
    if 0 < private_facts < len(private):      # evenly over the list, which is grouped by kind
        private = [private[i * len(private) // private_facts] for i in range(private_facts)]
    train = (_qa(app_facts_of(device), False) + _qa(private, False)) * qa_repeats
    _write_jsonl(out / HELDOUT_SHARED, _qa(APP_FACTS, True))
    _write_jsonl(out / HELDOUT_PRIVATE, _qa(private, True))
    _write_jsonl(out / TRAIN, train)   # last: its presence means the set is complete
    return {"device": device, "person_seed": seed, "app_facts": APP_FACTS_PER_DEVICE, "private_facts": len(private),
            "train_examples": len(train)}
