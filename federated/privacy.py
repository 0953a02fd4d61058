"""Central differential privacy on the aggregate, with Flower's own pieces rather than hand-written ones:

- the strategy wrapper `flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping` around Flower's FedAvg:
  each device's update (its tensors minus the global ones it was sent) is clipped to L2 norm `dp_clip` over all
  the tensors it sends, the clipped tensors are averaged, and Gaussian noise of standard deviation
  `dp_noise * dp_clip / N` is added to the mean;
- its accountant, `flwr.supercore.privacy_accounting.RdpAccountant` (Google's dp-accounting underneath), which
  gives the cumulative epsilon at `dp_delta` after every round and is persisted with the server's state.

What is protected: one device's whole data (client-level DP, add-or-remove-one neighbours, no sampling
amplification: every device is asked every round). The round's mean is over the k devices that trained, each with
weight 1 (the wrapper's accounting requires a uniform FedAvg over the num_sampled_clients it was built for, so the
wrapper is built per round for those k; the weighting by tokens is off), and the noise is scaled to it: each
round is a Gaussian mechanism of multiplier dp_noise on a mean in which one device moves at most dp_clip / k.
A declined device is not in the mean, as without DP. A round in which a device fails or does not answer is not
released: the global adapter stays as it was, and no privacy is spent.
"""
from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

WEIGHT = "dp-weight"        # every device's weight in the DP mean: 1


def arrays(tensors: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({n: Array(np.ascontiguousarray(v, dtype=np.float32)) for n, v in tensors.items()})


class _Participants:
    """What FedAvg.configure_train reads of a Grid (its node ids), limited to the devices that trained."""

    def __init__(self, node_ids: list[int]):
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


class CentralDP:
    def __init__(self, noise: float, clip: float, delta: float, devices: int, state: dict | None = None):
        self.noise, self.clip = noise, clip
        self.accountant = RdpAccountant(PrivacyConfig(
            target_delta=delta, population_size=devices, neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION))
        if state:
            self.accountant.load_state_dict(state)

    def aggregate(self, rnd: int, replies: list[Message], sent: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The noised mean of the trained devices' clipped updates, by Flower's wrapper (None: the round is not
        released). `sent`: the tensors the devices started from, in the order they were sent (the wrapper clips
        each reply against them position by position)."""
        if any(m.has_error() for m in replies):
            return None
        trained = [m for m in replies if "arrays" in m.content]
        if not trained:
            return None
        k = len(trained)
        wrapper = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=k, min_available_nodes=k,
                   weighted_by_key=WEIGHT),
            self.noise, self.clip, k, accountant=self.accountant)
        wrapper.configure_train(rnd, arrays(sent), ConfigRecord({}),
                                _Participants([m.metadata.src_node_id for m in trained]))
        for m in trained:
            record = m.content["arrays"]
            if list(record.keys()) != list(sent):
                raise RuntimeError(f"round {rnd}: a device returned tensors in another order than it was sent")
            m.content = RecordDict({"arrays": record, "metrics": MetricRecord({WEIGHT: 1.0})})
        out, _ = wrapper.aggregate_train(rnd, trained)
        if out is None:
            return None
        return {n: a.numpy().astype(np.float32) for n, a in out.items()}

    def spent(self) -> dict:
        s = self.accountant.get_privacy_spent()
        return {"epsilon": float(s.epsilon), "delta": float(s.delta), "releases": int(s.num_releases)}

    def state(self) -> dict:
        return self.accountant.state_dict()
