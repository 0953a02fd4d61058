"""Flower's ClientApp and ServerApp (the Message API of flwr 1.42) around device.py and the server's round loop.

Messages. Server -> device, "train": RecordDict {"arrays": the global LoRA tensors (FFA: B only), "config":
{"round", "out", "settings" (FederateConfig JSON)}}. Device -> server: {"metrics": {"device", "declined", and
when it trained "loss", "tokens", "examples", "steps"}, "info": {"reason": the gate's}, "arrays": its tensors
(FFA: B only), absent when it declined}. "evaluate" (after the last round): the same request; the reply carries
device.final_phase's numbers. A device that fails replies with an error; the round goes on without it.

The round loop is the server's own, not Strategy.start: it persists the global state after every round and
resumes after a kill, which Strategy.start (always from round 1) does not.

With --secagg (secure.py) a round is one run of Flower's SecAggPlusWorkflow instead: four train messages per
device (setup, share_keys, collect_masked_vectors, unmask), Flower's secaggplus_mod in front of the train
function, and at collect_masked_vectors the legacy FitIns / FitRes form the mod reads (secure.fit_request,
secure.fit_reply); the server gets only the weighted mean.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from . import device as dev
from . import secure
from . import state as fstate
from .aggregate import b_names, fedavg, ffa, product_gap
from .config import FederateConfig
from .privacy import CentralDP, arrays

client_app = ClientApp()


def _tensors(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {n: a.numpy() for n, a in record.items()}


def _request(conf, context: Context) -> tuple[FederateConfig, str, int, int]:
    """(settings, run directory, round, this device's number) from a request's config ({"round", "out",
    "settings"}). A SuperNode of the deployment engine may name its own bundle copy and directory
    (`--node-config "partition-id=I bundle='...' dir='...'"`); otherwise the server's paths are used (the
    simulation; one machine or a shared file system)."""
    cfg = FederateConfig.from_json(str(conf["settings"]))
    node = context.node_config
    device = int(node["partition-id"])
    if not 0 <= device < cfg.devices:
        raise ValueError(f"this node's partition-id is {device}; the run's devices are 0..{cfg.devices - 1}")
    if node.get("bundle"):
        cfg.bundle = str(node["bundle"])
    return cfg, str(node.get("dir") or conf["out"]), int(conf["round"]), device


def sent_names(cfg: FederateConfig, manifest) -> list[str]:
    """The tensors the server sends and the devices return, in this order: all trainable ones, or B's for FFA."""
    return b_names(manifest) if cfg.strategy == "ffa" else list(manifest.trainable_names)


@client_app.train(mods=[secure.secagg_mod])
def _train(msg: Message, context: Context) -> Message:
    if secure.is_fit_request(msg):
        return _train_secagg(msg, context)
    cfg, out, rnd, device = _request(msg.content["config"], context)
    decision = dev.gate_for_round(cfg, out, device, rnd)
    info = ConfigRecord({"reason": decision.reason, "gate": decision.state.value})
    if not decision.run_step:
        return Message(RecordDict({"metrics": MetricRecord({"device": device, "declined": 1}), "info": info}),
                       reply_to=msg)
    sent, stats = dev.train_round(cfg, out, device, rnd, _tensors(msg.content["arrays"]))
    metrics = MetricRecord({"device": device, "declined": 0, "loss": stats["loss"], "tokens": stats["tokens"],
                            "examples": stats["examples"], "steps": stats["steps"]})
    return Message(RecordDict({"arrays": arrays(sent), "metrics": metrics, "info": info}), reply_to=msg)


def _train_secagg(msg: Message, context: Context) -> Message:
    """A SecAgg+ round's collect_masked_vectors stage, called by Flower's secaggplus_mod: the request is legacy
    FitIns, the reply legacy FitRes (tensors in the sent order + the loss, weight = label tokens), which the mod
    masks; the reply's metrics are all the server sees of this device besides its weight. A declined device
    answers zeros with weight 0 (secure.py: that changes nothing, exactly)."""
    from ort_trainer.bundle import open_bundle

    cfg, out, rnd, device = _request(msg.content[secure.FITINS_CONFIG], context)
    man = open_bundle(cfg.bundle, verify="none").manifest
    names = sent_names(cfg, man)
    _, start = secure.fit_request(msg, names)
    decision = dev.gate_for_round(cfg, out, device, rnd)
    metrics = {"device": device, "declined": int(not decision.run_step), "reason": decision.reason,
               "gate": decision.state.value}
    if not decision.run_step:
        return secure.fit_reply(msg, secure.zeros(names, start), 0, metrics)
    sent, stats = dev.train_round(cfg, out, device, rnd, start)
    weight = int(stats[cfg.weight])
    if weight > secure.max_weight(cfg, man):
        raise RuntimeError(f"SecAgg+: weight {weight} > max_weight {secure.max_weight(cfg, man)}")
    return secure.fit_reply(msg, secure.vector(names, sent, stats["loss"], cfg.secagg_clip), weight, metrics)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    cfg, out, rnd, device = _request(msg.content["config"], context)
    decision = dev.gate_for_round(cfg, out, device, rnd)
    info = ConfigRecord({"reason": decision.reason, "gate": decision.state.value})
    if not decision.run_step:
        return Message(RecordDict({"metrics": MetricRecord({"device": device, "declined": 1}), "info": info}),
                       reply_to=msg)
    result = dev.final_phase(cfg, out, device, _tensors(msg.content["arrays"]))
    metrics = {k: v for k, v in result.items() if isinstance(v, (int, float))}
    return Message(RecordDict({"metrics": MetricRecord({**metrics, "declined": 0}), "info": info}), reply_to=msg)


# -- the server ---------------------------------------------------------------------------------------

def _wait_for_nodes(grid: Grid, n: int, timeout_s: float = 300.0) -> list[int]:
    t0 = time.time()
    while len(nodes := sorted(grid.get_node_ids())) < n:
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"only {len(nodes)} of {n} devices connected within {timeout_s:g} s")
        time.sleep(0.1)
    if len(nodes) > n:
        raise RuntimeError(f"{len(nodes)} nodes are connected, but the run has {n} devices: start one SuperNode "
                           "per device (partition-id 0..devices-1), or rerun with --devices matching")
    return nodes


def _send(grid: Grid, nodes: list[int], kind: str, tensors: dict[str, np.ndarray], cfg: FederateConfig,
          out: Path, rnd: int) -> tuple[list[Message], int]:
    payload = arrays(tensors)
    config = ConfigRecord({"round": rnd, "out": str(out), "settings": cfg.to_json()})
    messages = [Message(RecordDict({"arrays": payload, "config": config}), message_type=kind, dst_node_id=n)
                for n in nodes]
    replies = list(grid.send_and_receive(messages, timeout=cfg.round_timeout_s))
    return replies, payload.count_bytes() * len(nodes)


def _split(replies: list[Message]) -> tuple[list[tuple[int, dict, dict[str, np.ndarray] | None, int]], dict, list]:
    """(device, metrics, tensors, bytes) of the devices that trained; {device: reason} of those that declined;
    the errors of those that failed."""
    trained, declined, failed = [], {}, []
    for m in replies:
        if m.has_error():
            failed.append(f"node {m.metadata.src_node_id}: {m.error.reason}")
            continue
        metrics = dict(m.content["metrics"])
        d = int(metrics["device"])
        if d in declined or any(t[0] == d for t in trained):
            raise RuntimeError(f"two nodes answered as device {d}: every SuperNode needs its own partition-id")
        if metrics["declined"]:
            declined[d] = str(m.content["info"]["reason"])
            continue
        record = m.content["arrays"] if "arrays" in m.content else None
        trained.append((d, metrics, _tensors(record) if record is not None else None,
                        record.count_bytes() if record is not None else 0))
    trained.sort(key=lambda t: t[0])
    return trained, dict(sorted(declined.items())), failed


def aggregate(cfg: FederateConfig, manifest, global_lora: dict[str, np.ndarray], updates: list[dict[str, np.ndarray]],
              weights: list[float]) -> dict[str, np.ndarray]:
    """The new global adapter from the participants' tensors (aggregate.py's rule for cfg.strategy)."""
    if cfg.strategy == "ffa":
        frozen_a = {n: v for n, v in global_lora.items() if n not in set(b_names(manifest))}
        return ffa(updates, weights, frozen_a, b_names(manifest))
    return fedavg(updates, weights, manifest.trainable_names)


def server_loop(grid: Grid, cfg: FederateConfig, out: Path, log=print,
                context: Context | None = None) -> fstate.ServerState:
    """The rounds, then the final phase. `context`: the ServerApp's (--secagg runs Flower's SecAgg+ workflow in a
    LegacyContext around it)."""
    from ort_trainer import manifest as mf
    from ort_trainer.adapter import load_lora
    from ort_trainer.bundle import open_bundle

    man = open_bundle(cfg.bundle, verify="none").manifest
    config_sha = hashlib.sha256(json.dumps(cfg.fixed(), sort_keys=True).encode()).hexdigest()
    st = fstate.load(out)
    if st is None:
        st = fstate.ServerState(0, load_lora(open_bundle(cfg.bundle, verify="none").file(mf.CHECKPOINT), man),
                                config_sha256=config_sha)
    elif st.config_sha256 != config_sha:
        raise RuntimeError(f"{out / fstate.STATE} belongs to a run with other settings")
    else:
        log(f"resuming after round {st.round}/{cfg.rounds}")
        fstate.write_rounds(out, st)        # a kill between the state and rounds.jsonl left the latter behind
    dp = CentralDP(cfg.dp_noise, cfg.dp_clip, cfg.dp_delta, cfg.devices, st.privacy) if cfg.dp_noise > 0 else None
    if cfg.secagg and context is None:
        raise ValueError("--secagg: server_loop needs the ServerApp's context (SecAgg+ runs in a LegacyContext)")
    nodes = _wait_for_nodes(grid, cfg.devices)
    names = sent_names(cfg, man)
    for rnd in range(st.round + 1, cfg.rounds + 1):
        t0 = time.time()
        sent = {n: st.lora[n] for n in names}
        if cfg.secagg:
            st = _secure_round(grid, context, cfg, out, man, st, rnd, nodes, sent, t0, log)
            continue
        replies, bytes_down = _send(grid, nodes, MessageType.TRAIN, sent, cfg, out, rnd)
        trained, declined, failed = _split(replies)
        usable = [t for t in trained if t[2] is not None]
        updates = [t[2] for t in usable]
        weights = [float(t[1][cfg.weight]) for t in usable]
        if dp is not None:      # the mean of the clipped updates, uniform, plus noise (privacy.py)
            weights = [1.0] * len(usable)
            released = dp.aggregate(rnd, replies, sent) if len(replies) == len(nodes) else None
            new = {**st.lora, **released} if released is not None else None
        else:
            new = aggregate(cfg, man, st.lora, updates, weights) if updates else None
        aggregated = new is not None       # False: nothing to aggregate, or a DP round not released
        if aggregated:
            full_updates = [{**st.lora, **u} for u in updates]     # FFA: A is the shared init
            gap = product_gap(man, full_updates, weights, new)
        else:
            new, gap = st.lora, None
        record = {
            "round": rnd, "strategy": cfg.strategy, "weight": cfg.weight,
            "loss": (float(np.average([t[1]["loss"] for t in usable], weights=weights)) if updates else None),
            "participants": [t[0] for t in usable], "declined": declined, "failed": failed,
            "missing": len(nodes) - len(replies),          # no reply within round_timeout_s
            "weights": weights, "device_loss": {str(t[0]): t[1]["loss"] for t in usable},
            "bytes_up": int(sum(t[3] for t in usable)), "bytes_down": int(bytes_down),
            "product_gap": gap, "seconds": round(time.time() - t0, 3),
        }
        if dp is not None:
            record["dp"] = {"released": aggregated, "noise_multiplier": cfg.dp_noise, "clip": cfg.dp_clip,
                            **dp.spent()}
        st = _persist(out, cfg, st, new, record, usable, dp.state() if dp is not None else None, log)
    if not (out / fstate.FINAL).exists():
        replies, _ = _send(grid, nodes, MessageType.EVALUATE, {n: st.lora[n] for n in names}, cfg, out,
                           cfg.rounds + 1)
        results, declined, failed = [], {}, []
        for m in replies:
            if m.has_error():
                failed.append(f"node {m.metadata.src_node_id}: {m.error.reason}")
                continue
            metrics = dict(m.content["metrics"])
            if metrics["declined"]:
                declined[int(metrics["device"])] = str(m.content["info"]["reason"])
            else:
                results.append(metrics)
        final = {"devices": sorted(results, key=lambda r: r["device"]), "declined": dict(sorted(declined.items())),
                 "failed": failed}
        fstate.write_atomic(out / fstate.FINAL, json.dumps(final, indent=1).encode())
        log(f"final phase: {len(results)} devices reported, {len(declined)} declined, {len(failed)} failed")
    return st


def _secure_round(grid, context, cfg, out, man, st, rnd, nodes, sent, t0, log) -> fstate.ServerState:
    """One round through Flower's SecAgg+ (secure.py), persisted as any round. The record holds what the server
    still knows: who trained or declined (and why), their weights, the weighted mean loss; no device's loss or
    tensors (device_loss and product_gap are None). --keep-updates keeps the global only."""
    r = secure.secure_round(grid, context, cfg, man, rnd, nodes, sent,
                            {"round": rnd, "out": str(out), "settings": cfg.to_json()})
    new = {**st.lora, **r.released} if r.released is not None else st.lora
    record = {"round": rnd, "strategy": cfg.strategy, "weight": cfg.weight, **r.record,
              "seconds": round(time.time() - t0, 3)}
    return _persist(out, cfg, st, new, record, [], None, log,
                    f" (SecAgg+, {'released' if r.released is not None else 'NOT released'})")


def _persist(out: Path, cfg: FederateConfig, st: fstate.ServerState, new: dict[str, np.ndarray], record: dict,
             usable, privacy: dict | None, log, how: str = "") -> fstate.ServerState:
    """The end of every round: the new state (global adapter, records, DP accountant) written atomically, the
    updates kept with --keep-updates, one log line."""
    rnd = record["round"]
    if cfg.keep_updates:
        _keep(out, rnd, usable, new)
    st = fstate.ServerState(rnd, new, st.records + [record], st.config_sha256, privacy)
    fstate.save(out, st)
    loss = record["loss"] if record["loss"] is None else round(record["loss"], 4)
    log(f"round {rnd}/{cfg.rounds}{how}: loss {loss}, {len(record['participants'])} trained, "
        f"{len(record['declined'])} declined, {len(record['failed'])} failed, "
        f"{record['bytes_up'] / 1e6:.2f} MB up, {record['seconds']:.1f} s")
    return st


def _keep(out: Path, rnd: int, usable, new: dict[str, np.ndarray]) -> None:
    """DIR/updates/round-RRR/: every device's update and the new global (under SecAgg+ the global only: the
    server never has a device's tensors)."""
    d = out / "updates" / f"round-{rnd:03d}"
    d.mkdir(parents=True, exist_ok=True)
    for device, metrics, tensors, _ in usable:
        np.savez(d / f"device-{device:03d}.npz", **{n.replace("/", "|"): v for n, v in tensors.items()})
        (d / f"device-{device:03d}.json").write_text(json.dumps(metrics))
    np.savez(d / "global.npz", **{n.replace("/", "|"): v for n, v in new.items()})


def make_server_app(cfg: FederateConfig, out: Path, log=print) -> ServerApp:
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        server_loop(grid, cfg, out, log, context)

    return app
