// The run: settings, resume, battery gate, steps, metrics, checkpoints, stop requests. android_runner/loop.py's
// contract (same settings, defaults, run.json fields, metrics.jsonl keys, summary fields, resume rules and gate
// semantics). Platform-free: files go through a `store` (node/store.mjs on Node; a browser store would use
// OPFS), examples through a data source:
//
//   data source = {
//     microBatchesPerEpoch: number,          // DataOrder.steps_per_epoch(): micro-batches in one epoch
//     nextMicroBatch(): batch,               // engine.makeBatch()-shaped: {dims, input_ids, attention_mask, labels}
//     state(): JSON value,                   // points at the next micro-batch
//     loadState(value): void,
//   }
import { LoraEngine, EngineError } from './engine.mjs';
import { lrAt, SCHEDULES } from './schedule.mjs';
import { EnergyMeter } from './energy.mjs';
import { GateConfig, GateState, GateTracker, SafeProbe, makeProbe } from './gate/index.mjs';

export class RunError extends Error {}

// ort_trainer.settings.TrainSettings + android_runner.loop.RunConfig defaults. battery, gate and threads are not
// part of the training's definition: they may change between resumes (run.json keeps the first start's).
export const DEFAULTS = {
  bundle: null, data: null, epochs: null, max_steps: null, micro_batch: 1, accum: 8, lr: 2e-4, warmup: 10,
  schedule: 'cosine', clip: 1.0, weight_decay: 0.0, seed: 0, group_by_length: false, save_every: 50,
  battery: 'auto', gate: new GateConfig().toJSON(), threads: 0,
};
export const FIXED = ['bundle', 'data', 'epochs', 'max_steps', 'micro_batch', 'accum', 'lr', 'warmup', 'schedule',
  'clip', 'weight_decay', 'seed', 'group_by_length'];

export function validate(cfg) {
  if ((cfg.epochs == null) === (cfg.max_steps == null)) throw new RunError('give exactly one of --epochs N or --max-steps N');
  for (const name of ['micro_batch', 'accum', 'save_every']) {
    if (!(Number.isInteger(cfg[name]) && cfg[name] >= 1)) throw new RunError(`--${name.replace('_', '-')} must be >= 1`);
  }
  if (!SCHEDULES.includes(cfg.schedule)) throw new RunError(`--schedule ${cfg.schedule}: use one of ${SCHEDULES.join(', ')}`);
  if (!(cfg.lr > 0)) throw new RunError('--lr must be > 0');
  try {
    new GateConfig(cfg.gate ?? {}).validate();
  } catch (e) {
    throw new RunError(e.message);
  }
}

const round = (x, digits) => Math.round(x * 10 ** digits) / 10 ** digits;

/** Sleep `seconds`, or less if shouldStop() turns true (checked every 50 ms): Python's Event.wait. */
export async function interruptibleSleep(seconds, shouldStop = () => false) {
  const end = Date.now() + seconds * 1000;
  while (!shouldStop()) {
    const left = end - Date.now();
    if (left <= 0) return;
    await new Promise((resolve) => setTimeout(resolve, Math.min(left, 50)));
  }
}

function settle(saved, cfg, runDir) {
  if (!saved) return [cfg, false];
  if (saved.runner !== 'web') {
    throw new RunError(`${runDir} is a run of the Python runner (\`pocketlora train\`); its checkpoints are ORT's. ` +
      'Continue it there, or train into a new --out.');
  }
  for (const name of FIXED) {
    const was = name in saved ? saved[name] : DEFAULTS[name];
    if (cfg[name] !== was) {
      throw new RunError(`${runDir} was started with ${name}=${JSON.stringify(was)}, not ${JSON.stringify(cfg[name])}. ` +
        'To resume, repeat the original settings; to change them, train into a new --out.');
    }
  }
  return [cfg, true];
}

/**
 * Train. ort: onnxruntime-web training module; bundle: {manifest, read}; data: a data source; store: run files.
 * options: {log, shouldStop: () => bool (a signal: finish the micro-batch, checkpoint, return),
 *           stopReason: () => string, sessionOptions,
 *           probe: a battery probe (src/gate; default: makeProbe(cfg.battery, probeOptions)), probeOptions,
 *           sleep: (seconds) => Promise (default: interruptibleSleep with shouldStop),
 *           cpuSeconds: () => number (process CPU time for the energy estimate; absent in a browser),
 *           collectGarbage: () => void (after the session is created; see LoraEngine.open)}.
 */
export async function train(cfg, { ort, bundle, data, store, log = console.log, shouldStop = () => false,
  stopReason = () => 'signal', sessionOptions, probe = null, probeOptions = {}, sleep = null,
  cpuSeconds = null, collectGarbage = null } = {}) {
  cfg = { ...DEFAULTS, ...cfg };
  cfg.gate = new GateConfig(cfg.gate ?? {}).toJSON();
  cfg.clip = cfg.clip && cfg.clip > 0 ? cfg.clip : null;
  validate(cfg);
  let resuming;
  [cfg, resuming] = settle(await store.loadConfig(), cfg, store.runDir);

  const engine = await LoraEngine.open(ort, bundle, {
    adamw: { clip: cfg.clip, weight_decay: cfg.weight_decay }, sessionOptions, collectGarbage,
  });
  if (!resuming) await store.saveConfig({ ...cfg, runner: 'web' });

  const stepsPerEpoch = Math.max(1, Math.floor(data.microBatchesPerEpoch / cfg.accum));
  const total = cfg.max_steps ?? cfg.epochs * stepsPerEpoch;
  let step = 0;
  const found = resuming ? await store.latest(log) : null;
  if (found) {
    const meta = engine.loadState(found.weights);
    step = found.state.step;
    if (Number(meta.optimizer_step) !== step) throw new RunError(`${found.name}: optimizer step ${meta.optimizer_step} != step ${step}`);
    data.loadState(found.state.data);
    log(`resuming ${store.runDir} at step ${step}/${total} from ${found.name}`);
  }
  await store.openMetrics(step);

  // -- gate (android_runner/loop.py: read before every step; pause/cool: checkpoint once, wait, ask again) ---
  const safeProbe = new SafeProbe(probe ?? await makeProbe(cfg.battery, { log, ...probeOptions }), { warn: log });
  log(`battery probe: ${safeProbe.inner.chosen_because ?? safeProbe.inner.name}`);
  const tracker = new GateTracker(new GateConfig(cfg.gate));
  const energy = new EnergyMeter({ cpuSeconds });
  const wait = sleep ?? ((seconds) => interruptibleSleep(seconds, shouldStop));

  const save = async (reason) => {
    await store.save(step, engine.saveState({ step }), {
      step, total_steps: total, data: data.state(), seed: cfg.seed, reason, runner: 'web',
    });
  };

  const t0 = Date.now();
  let savedAt = step, tokensTotal = 0, stoppedBy = null, lastStepS = 0.0;
  while (step < total) {
    if (shouldStop()) { stoppedBy = stopReason(); break; }
    const reading = await safeProbe.read();
    energy.add(reading, Date.now() / 1000);
    const decision = tracker.update(reading, lastStepS);
    if (decision.changed) log(`gate: ${decision.state} (${decision.reason})`);
    if (!decision.run_step) {                 // paused or cooling: keep the work safe, then wait
      if (savedAt !== step) {
        await save(`gate ${decision.state}`);
        savedAt = step;
      }
      await wait(decision.sleep_s);
      continue;
    }

    const position = data.state();
    const micro = Array.from({ length: cfg.accum }, () => data.nextMicroBatch());
    const lr = lrAt(step, cfg.lr, cfg.warmup, total, cfg.schedule);
    const result = await engine.trainStep(micro, lr, shouldStop);
    if (result === null) {                 // stopped mid-step: that step runs again on resume
      data.loadState(position);
      stoppedBy = stopReason();
      break;
    }
    step += 1;
    lastStepS = result.seconds;
    tokensTotal += result.tokens;
    await store.writeMetrics({
      step, loss: result.loss, lr, grad_norm: result.grad_norm, tokens: result.tokens,
      label_tokens: result.label_tokens, step_s: round(result.seconds, 4),
      tokens_per_s: round(result.tokens / result.seconds, 1), rss_mb: store.rssMb?.() ?? null,
      battery_percent: reading.percent, charging: reading.charging, temp_c: reading.temp_c, gate: decision.state,
      time: Math.round(Date.now()) / 1000,
    });
    if (step % cfg.save_every === 0 || step === total) {
      await save(step < total ? 'periodic' : 'final');
      savedAt = step;
    }
    if (decision.state === GateState.SLOW && decision.sleep_s > 0) await wait(decision.sleep_s);
  }
  if (savedAt !== step) await save(stoppedBy ? `signal ${stoppedBy}` : 'final');
  await store.closeMetrics();
  await engine.release();
  tracker.finish();
  const wall = (Date.now() - t0) / 1000;
  const summary = {
    run: store.runDir, bundle: cfg.bundle, data: cfg.data, finished: step >= total, stopped_by: stoppedBy,
    step, total_steps: total, wall_s: round(wall, 2), tokens_this_session: tokensTotal,
    tokens_per_s: wall > 0 ? round(tokensTotal / wall, 1) : null,
    peak_rss_mb: store.peakRssMb?.() ?? null, torch_in_process: false, memory_fit: null,
    gate: tracker.summary(), ...energy.summary(wall), data_report: data.report ?? null, runner: 'web',
  };
  await store.writeSummary(summary);
  log(`${summary.finished ? 'finished' : 'stopped'} at step ${step}/${total} in ${wall.toFixed(1)} s`);
  return summary;
}

export { EngineError };
