// The battery/thermal gate for the web runner: policy (android_runner/gate.py) and probes (android_runner/probes.py).
//   const probe = new SafeProbe(await makeProbe(spec, { log }), { warn: log });
//   const tracker = new GateTracker(new GateConfig({ pause_below: 15 }));
//   const decision = tracker.update(await probe.read(), lastStepSeconds);   // {state, sleep_s, run_step, reason, changed}
//   ... tracker.finish(); summary.gate = tracker.summary();
export { GateState, GateConfig, GATE_DEFAULTS, GateTracker, decide, gateState } from './policy.mjs';
export {
  BatteryReading, BrowserBatteryProbe, COMMAND_TIMEOUT_S, NoneProbe, ProbeError, ReplayProbe, SafeProbe, SPECS,
  TermuxProbe, makeProbe, runCommand,
} from './probes.mjs';
