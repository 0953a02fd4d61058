// The run: settings, resume, steps, metrics, checkpoints, stop requests. android_runner/loop.py's contract
// (same settings, defaults, run.json fields, metrics.jsonl keys and resume rules) without the battery gate
// yet. Platform-free: files go through a `store` (node/store.mjs on Node; a browser store would use OPFS),
// examples through a data source:
//
//   data source = {
//     microBatchesPerEpoch: number,          // DataOrder.steps_per_epoch(): micro-batches in one epoch
//     nextMicroBatch(): batch,               // engine.makeBatch()-shaped: {dims, input_ids, attention_mask, labels}
//     state(): JSON value,                   // points at the next micro-batch
//     loadState(value): void,
//   }
import { LoraEngine, EngineError } from './engine.mjs';
import { lrAt, SCHEDULES } from './schedule.mjs';

export class RunError extends Error {}

// ort_trainer.settings.TrainSettings + android_runner.loop.RunConfig defaults.
export const DEFAULTS = {
  bundle: null, data: null, epochs: null, max_steps: null, micro_batch: 1, accum: 8, lr: 2e-4, warmup: 10,
  schedule: 'cosine', clip: 1.0, weight_decay: 0.0, seed: 0, group_by_length: false, save_every: 50,
  threads: 0,
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
 *           afterStep: (step) => void, sessionOptions}.
 */
export async function train(cfg, { ort, bundle, data, store, log = console.log, shouldStop = () => false,
  stopReason = () => 'signal', sessionOptions } = {}) {
  cfg = { ...DEFAULTS, ...cfg };
  cfg.clip = cfg.clip && cfg.clip > 0 ? cfg.clip : null;
  validate(cfg);
  let resuming;
  [cfg, resuming] = settle(await store.loadConfig(), cfg, store.runDir);

  const engine = await LoraEngine.open(ort, bundle, {
    adamw: { clip: cfg.clip, weight_decay: cfg.weight_decay }, sessionOptions,
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

  const save = async (reason) => {
    await store.save(step, engine.saveState({ step }), {
      step, total_steps: total, data: data.state(), seed: cfg.seed, reason, runner: 'web',
    });
  };

  const t0 = Date.now();
  let savedAt = step, tokensTotal = 0, stoppedBy = null;
  while (step < total) {
    if (shouldStop()) { stoppedBy = stopReason(); break; }
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
    tokensTotal += result.tokens;
    await store.writeMetrics({
      step, loss: result.loss, lr, grad_norm: result.grad_norm, tokens: result.tokens,
      label_tokens: result.label_tokens, step_s: Math.round(result.seconds * 1e4) / 1e4,
      tokens_per_s: Math.round((result.tokens / result.seconds) * 10) / 10, rss_mb: store.rssMb?.() ?? null,
      time: Math.round(Date.now()) / 1000,
    });
    if (step % cfg.save_every === 0 || step === total) {
      await save(step < total ? 'periodic' : 'final');
      savedAt = step;
    }
  }
  if (savedAt !== step) await save(stoppedBy ? `signal ${stoppedBy}` : 'final');
  await store.closeMetrics();
  await engine.release();
  const wall = (Date.now() - t0) / 1000;
  const summary = {
    run: store.runDir, bundle: cfg.bundle, data: cfg.data, finished: step >= total, stopped_by: stoppedBy,
    step, total_steps: total, wall_s: Math.round(wall * 100) / 100, tokens_this_session: tokensTotal,
    tokens_per_s: wall > 0 ? Math.round((tokensTotal / wall) * 10) / 10 : null, runner: 'web',
  };
  await store.writeSummary(summary);
  log(`${summary.finished ? 'finished' : 'stopped'} at step ${step}/${total} in ${wall.toFixed(1)} s`);
  return summary;
}

export { EngineError };
