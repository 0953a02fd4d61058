"""Federated personalization: many devices train the same bundle's LoRA on their own data, with Flower.

Each device runs the existing device loop (android_runner.loop.train: battery gate, kill-safe checkpoints) for a
few local steps per round, starting from the global LoRA tensors, and sends only LoRA tensors back. The server
aggregates them (aggregate.py: FedAvg or FFA-LoRA), persists the global state after every round (resumable), and
at the end every device reports global-only, local-only and federated+personalized results on its own held-out
questions.

    data.py       what each simulated device holds: shared facts about the app + one person's private facts
    aggregate.py  the aggregation rules, plain numpy
    device.py     the device's side: gate check, one round of local training, evaluation, personalization
    apps.py       Flower's ClientApp and ServerApp (Message API) around device.py and the server's round loop
    state.py      the server's persisted state (global tensors + round records, one atomic file)
    run.py        `pocketlora federate`: settings, the simulation engine, the report
    deployment.py the ServerApp for Flower's deployment engine (SuperLink + SuperNodes; flower_app/, docs/FEDERATED.md)
"""
import sys


def _device_process() -> None:
    """A device runs as on a phone: in Ray's worker processes (where the simulation engine runs the devices) and in
    a SuperNode's `flwr-clientapp` processes (the deployment engine's) torch is kept out, as `pocketlora train` does
    (onnxruntime-training imports it whenever it is installed: seconds and ~200 MB per process, which no device
    pays). Elsewhere nothing changes."""
    main = sys.modules.get("__main__")
    if not str(getattr(main, "__file__", "")).endswith(("default_worker.py", "flwr-clientapp")):
        return
    from ort_trainer.device_view import as_on_device

    as_on_device()


_device_process()
