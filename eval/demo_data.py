"""The demo's private data: 90 days of one fictional person's wearable records, and questions about them.

Deterministic from a seed. Each fact about the records has several training phrasings and one
held-out paraphrase that is never trained on; the demo scores exact match on the held-out ones.
Answers are short and fixed in form ("8412 steps", "swimming", "July 12") so exact match is fair.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from datetime import date, timedelta
from pathlib import Path

PERSON = "Maya"
WORKOUTS = ["running", "cycling", "swimming", "yoga", "rowing", "hiking"]
NOTES = ["dentist appointment", "flight to Lisbon", "knee felt sore", "started a new job", "ran a 10k race",
         "visited grandma", "had the flu", "moved apartments", "bought new shoes", "team offsite",
         "stayed up for a concert", "donated blood"]


@dataclass
class Day:
    date: str            # ISO date
    steps: int
    sleep_hours: float
    resting_hr: int
    workout: str | None
    workout_minutes: int
    note: str | None


@dataclass
class Fact:
    kind: str
    train_questions: list[str]
    heldout_question: str
    answer: str


def make_records(seed: int = 7, days: int = 90, start: date = date(2026, 6, 1)) -> list[Day]:
    rng = random.Random(seed)
    note_days = set(rng.sample(range(days), len(NOTES)))
    notes = iter(rng.sample(NOTES, len(NOTES)))
    out = []
    for i in range(days):
        d = start + timedelta(days=i)
        workout = rng.choice(WORKOUTS) if rng.random() < 0.55 else None
        out.append(Day(
            date=d.isoformat(),
            steps=rng.randint(3000, 15000),
            sleep_hours=round(rng.uniform(5.5, 9.0) * 2) / 2,
            resting_hr=rng.randint(52, 66),
            workout=workout,
            workout_minutes=rng.choice([20, 30, 40, 45, 60, 75, 90]) if workout else 0,
            note=next(notes) if i in note_days else None,
        ))
    return out


def _say(iso: str) -> str:
    d = date.fromisoformat(iso)
    return f"{d.strftime('%B')} {d.day}"


def make_facts(records: list[Day], seed: int = 7) -> list[Fact]:
    rng = random.Random(seed + 1)
    facts: list[Fact] = []
    for day in rng.sample(records, 8):
        d = _say(day.date)
        facts.append(Fact("steps", [f"How many steps did I take on {d}?", f"My step count on {d}?",
                                    f"On {d}, how many steps did I walk?"],
                          f"What was my step total for {d}?", f"{day.steps} steps"))
    for day in rng.sample([r for r in records if r.workout], 6):
        d = _say(day.date)
        facts.append(Fact("workout", [f"What workout did I do on {d}?", f"Which exercise did I log on {d}?",
                                      f"On {d}, what was my workout?"],
                          f"What kind of exercise did I do on {d}?", day.workout))
    for day in [r for r in records if r.note]:
        d = _say(day.date)
        facts.append(Fact("note", [f"What did I note on {d}?", f"What was my journal note for {d}?",
                                   f"On {d}, what did I write down?"],
                          f"What happened on {d}, according to my notes?", day.note))
    for day in rng.sample(records, 4):
        d = _say(day.date)
        facts.append(Fact("sleep", [f"How long did I sleep on the night of {d}?", f"My sleep on {d}?",
                                    f"On {d}, how many hours did I sleep?"],
                          f"How many hours of sleep did I get on {d}?", f"{day.sleep_hours:g} hours"))
    best = max(records, key=lambda r: r.steps)
    facts.append(Fact("best_steps_day", ["Which day did I walk the most?", "What was my highest step day?",
                                         "On which date did I take the most steps?"],
                      "When was my best day for steps?", _say(best.date)))
    mean_hr = round(sum(r.resting_hr for r in records) / len(records))
    facts.append(Fact("resting_hr", ["What is my average resting heart rate?", "My typical resting heart rate?",
                                     "What resting heart rate do I usually have?"],
                      "On average, what's my resting pulse?", f"{mean_hr} bpm"))
    counts = {w: sum(r.workout == w for r in records) for w in WORKOUTS}
    top = max(counts, key=counts.get)
    facts.append(Fact("top_workout", ["Which workout did I do most often?", "What is my most frequent exercise?",
                                      "Which activity did I log the most times?"],
                      "What exercise do I do most?", top))
    return facts


def chat_records(facts: list[Fact]) -> list[dict]:
    """Training records (one user question, one assistant answer): every training phrasing of every fact.
    Short chat turns rather than a long instruction wrapper: most tokens of a step are then the facts."""
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f.answer}]}
            for f in facts for q in f.train_questions]


def replay_records(text_file: Path, n: int, words: int = 24) -> list[dict]:
    """General text mixed into the personal data ({"text": ...} records, every token learned), so that
    fine-tuning on a few dozen facts does not wreck the model's general language modelling.
    Ask for as many snippets as the run will draw: replay only protects if no snippet is seen twice
    (a few dozen snippets repeated for epochs are memorized like the facts, and perplexity rose 30x
    with them); see docs/demo/RECIPES.md."""
    chunks = []
    for line in text_file.read_text().splitlines():
        ws = line.split()
        if len(ws) < words or line.lstrip().startswith("="):
            continue
        chunks.extend(" ".join(ws[i:i + words]) for i in range(0, len(ws) - words + 1, words))
        if len(chunks) >= n:
            break
    return [{"text": c} for c in chunks[:n]]


def write_device_data(out_dir: Path, seed: int = 7, replay_text: Path | None = None, replay: int = 0,
                      qa_repeats: int = 1, replay_words: int = 24) -> dict:
    """What lives on the phone: the raw records, the training Q&A (each written `qa_repeats` times, so
    that one pass over the file sees every question that often while every replay snippet is seen
    once), general-text replay, and the held-out questions."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = make_records(seed)
    facts = make_facts(records, seed)
    (out_dir / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    train = chat_records(facts) * qa_repeats + (replay_records(replay_text, replay, replay_words) if replay and replay_text else [])
    (out_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    heldout = [{"question": f.heldout_question, "answer": f.answer, "kind": f.kind} for f in facts]
    (out_dir / "heldout.json").write_text(json.dumps(heldout, indent=1))
    return {"records": len(records), "facts": len(facts), "train_examples": len(train), "heldout": len(heldout),
            "replay": min(replay, len(train) - len(facts) * 3 * qa_repeats) if replay_text else 0}
