#!/usr/bin/env node
// pocketlora-web: the phone runner's training loop on Node (onnxruntime-web WASM).
//
//   node cli.mjs train --bundle B --data D --out R (--max-steps N | --epochs N) [--micro-batch 1 --accum 8
//        --lr 2e-4 --warmup 10 --schedule cosine --clip 1.0 --weight-decay 0 --seed 0 --save-every 50 --threads 1
//        --battery auto|termux|replay:TRACE.csv[@SPEED]|none --slow-below 60 --slow-factor 0.5 --pause-below 15
//        --resume-above 30 --max-temp 42]
//
// Flags and defaults are `pocketlora train`'s. Running the same command again on an existing --out resumes
// from its last good checkpoint; SIGTERM/SIGINT finish the micro-batch, checkpoint and exit 0. The battery gate
// is android_runner/loop.py's (src/gate; `browser`, the Battery Status API, exists only in the page). Known,
// user-fixable errors print one line and exit 2. The run directory is read by `pocketlora export --run R`.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

import { collectGarbage, loadOrt } from './src/node/ort.mjs';
import { NodeRunStore, cpuSeconds, openBundleDir } from './src/node/store.mjs';
import { FORMAT as PRETOKENIZED, PretokenizedSource } from './src/pretokenized.mjs';
import { DEFAULTS, RunError, train } from './src/runner.mjs';
import { EngineError } from './src/engine.mjs';
import { makeProbe } from './src/gate/index.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));

const TRAIN_FLAGS = {
  bundle: { type: 'string' }, data: { type: 'string' }, out: { type: 'string' },
  epochs: { type: 'string' }, 'max-steps': { type: 'string' },
  'micro-batch': { type: 'string' }, accum: { type: 'string' }, lr: { type: 'string' }, warmup: { type: 'string' },
  schedule: { type: 'string' }, clip: { type: 'string' }, 'weight-decay': { type: 'string' }, seed: { type: 'string' },
  'group-by-length': { type: 'boolean' }, 'save-every': { type: 'string' }, threads: { type: 'string' },
  battery: { type: 'string' }, 'slow-below': { type: 'string' }, 'slow-factor': { type: 'string' },
  'pause-below': { type: 'string' }, 'resume-above': { type: 'string' }, 'max-temp': { type: 'string' },
  help: { type: 'boolean', short: 'h' },
};
// pocketlora train's gate flags -> GateConfig fields (its defaults when absent: src/gate/policy.mjs).
const GATE_FLAGS = { 'slow-below': 'slow_below', 'slow-factor': 'slow_factor', 'pause-below': 'pause_below',
  'resume-above': 'resume_above', 'max-temp': 'max_temp' };
const NODE_PROBES = 'auto|termux|replay:TRACE.csv[@SPEED]|none';

class UsageError extends Error {}

function number(name, text, integer) {
  if (text === undefined) return undefined;
  const v = Number(text);
  if (text.trim() === '' || !Number.isFinite(v) || (integer && !Number.isInteger(v))) {
    throw new UsageError(`--${name}: invalid ${integer ? 'int' : 'float'} value: '${text}'`);
  }
  return v;
}

/** argv parsed strictly against `options`; a parse error is a UsageError (one line, exit 2). */
function flags(argv, options) {
  try {
    return parseArgs({ args: argv, options, strict: true, allowPositionals: false }).values;
  } catch (e) {
    throw new UsageError(e.message);
  }
}

export function parseTrainArgs(argv) {
  const values = flags(argv, TRAIN_FLAGS);
  if (values.help) return { help: true };
  for (const req of ['bundle', 'data', 'out']) if (!values[req]) throw new UsageError(`the following arguments are required: --${req}`);
  if (values.epochs !== undefined && values['max-steps'] !== undefined) throw new UsageError('--max-steps: not allowed with argument --epochs');
  const pick = (name, key, integer) => number(name, values[name], integer) ?? DEFAULTS[key];
  const clip = pick('clip', 'clip', false);
  return {
    out: values.out,
    cfg: {
      bundle: values.bundle, data: values.data,
      epochs: number('epochs', values.epochs, true) ?? null, max_steps: number('max-steps', values['max-steps'], true) ?? null,
      micro_batch: pick('micro-batch', 'micro_batch', true), accum: pick('accum', 'accum', true),
      lr: pick('lr', 'lr', false), warmup: pick('warmup', 'warmup', true),
      schedule: values.schedule ?? DEFAULTS.schedule, clip: clip && clip > 0 ? clip : null,
      weight_decay: pick('weight-decay', 'weight_decay', false), seed: pick('seed', 'seed', true),
      group_by_length: Boolean(values['group-by-length']), save_every: pick('save-every', 'save_every', true),
      threads: pick('threads', 'threads', true),
      battery: values.battery ?? DEFAULTS.battery,
      gate: { ...DEFAULTS.gate, ...Object.fromEntries(Object.entries(GATE_FLAGS)
        .filter(([flag]) => values[flag] !== undefined).map(([flag, key]) => [key, number(flag, values[flag], false)])) },
    },
  };
}

/** The battery probe for --battery, built before the (slow) session so that a bad spec fails at once. */
async function openProbe(spec, options) {
  if (spec.trim() === 'browser') {
    throw new UsageError(`--battery browser: the Battery Status API is the page's (pocketlora web); here: ${NODE_PROBES}`);
  }
  try {
    return await makeProbe(spec, options);
  } catch (e) {
    throw new UsageError(`--battery ${spec}: ${e.message}`);
  }
}

/** The data source for --data: a pre-tokenized micro-batch file, else a training file through src/data/. */
async function openData(cfg, bundle) {
  if (cfg.data.endsWith('.json')) {
    const doc = JSON.parse(fs.readFileSync(cfg.data, 'utf8'));
    if (doc && doc.format === PRETOKENIZED) return new PretokenizedSource(doc, { microBatch: cfg.micro_batch });
  }
  const { TextTokenizer, openTextSource } = await import('./src/text_source.mjs');
  const tokenizer = await TextTokenizer.fromDir(path.join(bundle.path, 'tokenizer'));
  return openTextSource({
    tokenizer, dataPath: cfg.data, data: fs.readFileSync(cfg.data), microBatch: cfg.micro_batch, seed: cfg.seed,
    seqLen: bundle.manifest.seq_len, groupByLength: cfg.group_by_length, log: (m) => console.error(m),
  });
}

const USAGE = 'usage: cli.mjs train --bundle B --data D --out R (--max-steps N | --epochs N) [--micro-batch N] [--accum N] ' +
  '[--lr F] [--warmup N] [--schedule cosine|linear|constant] [--clip F] [--weight-decay F] [--seed N] [--save-every N] [--threads N] ' +
  `[--battery ${NODE_PROBES}] [--slow-below F] [--slow-factor F] [--pause-below F] [--resume-above F] [--max-temp F]`;

/**
 * The `train` command. hooks (tests and benches; the command line never sets them): probeOptions (e.g. a replay
 * clock), gate (GateConfig fields the CLI has no flag for, e.g. poll_s), wrapStore(store) -> store,
 * sessionOptions (extra InferenceSession options, e.g. bench/web_driver.mjs's prepacking variant).
 */
export async function main(argv, hooks = {}) {
  const [verb, ...rest] = argv;
  if (verb === 'generate') return generateCommand(rest);
  if (verb !== 'train') throw new UsageError(USAGE);
  const args = parseTrainArgs(rest);
  if (args.help) { console.log(USAGE); return 0; }
  const { cfg, out } = args;
  if (hooks.gate) cfg.gate = { ...cfg.gate, ...hooks.gate };

  let stopSignal = null;
  for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => { stopSignal = sig; });

  const log = (m) => console.error(m);
  const bundle = await openBundleDir(cfg.bundle);
  const data = await openData(cfg, bundle);
  const probe = await openProbe(cfg.battery, { log, ...(hooks.probeOptions ?? {}) });
  const ort = await loadOrt({ threads: cfg.threads });
  const store = new NodeRunStore(out);
  await train(cfg, {
    ort, bundle, data, store: hooks.wrapStore ? hooks.wrapStore(store) : store, probe, cpuSeconds, collectGarbage,
    shouldStop: () => stopSignal !== null, stopReason: () => stopSignal, log, sessionOptions: hooks.sessionOptions,
  });
  return 0;
}

const GENERATE_FLAGS = {
  bundle: { type: 'string' }, run: { type: 'string' }, prompt: { type: 'string', multiple: true },
  raw: { type: 'boolean' }, 'max-new-tokens': { type: 'string' }, greedy: { type: 'boolean' },
  temperature: { type: 'string' }, 'top-k': { type: 'string' }, 'top-p': { type: 'string' }, seed: { type: 'string' },
  json: { type: 'boolean' }, threads: { type: 'string' },
  'logit-stats': { type: 'string' },     // tests: per step and row [max, sum, sum of squares] of the logits, as JSON
};
const GENERATE_USAGE = 'usage: cli.mjs generate --bundle B [--run R] --prompt TEXT [--prompt TEXT ...] [--raw] ' +
  '[--max-new-tokens 128] [--greedy | --temperature 0.7 --top-k 50 --top-p 0.95 --seed 0] [--json] [--threads N]';

/** The `generate` command: `pocketlora generate` on the bundle's decoder in WASM, with a run's latest adapter. */
async function generateCommand(argv) {
  const values = flags(argv, GENERATE_FLAGS);
  if (!values.bundle || !values.prompt) throw new UsageError(GENERATE_USAGE);
  const { Decoder, generate, turnEndIds } = await import('./src/decoder.mjs');
  const { TextTokenizer } = await import('./src/text_source.mjs');
  const { readSafetensors } = await import('./src/safetensors.mjs');
  const bundle = await openBundleDir(values.bundle);
  const tok = await TextTokenizer.fromDir(path.join(bundle.path, 'tokenizer'));
  const sampling = {
    maxNewTokens: number('max-new-tokens', values['max-new-tokens'], true) ?? 128,
    temperature: values.greedy ? 0 : number('temperature', values.temperature, false) ?? 0.7,
    topK: number('top-k', values['top-k'], true) ?? 50, topP: number('top-p', values['top-p'], false) ?? 0.95,
    seed: number('seed', values.seed, true) ?? 0,
  };
  const prompts = values.prompt.map((text) => {
    if (!text.trim()) throw new UsageError('empty prompt: give some text');
    return values.raw ? [...tok.prefixIds, ...tok.encode(text, false)]
      : tok.generationPromptIds([{ role: 'user', content: text }]);
  });
  // onnxruntime-web's own default (0) looks up the cores with a require() its ES module cannot make in Node
  const ort = await loadOrt({ threads: number('threads', values.threads, true) || Math.min(4, os.availableParallelism()) });
  const decoder = await Decoder.open(ort, bundle, { collectGarbage });
  if (values.run) {
    const found = await new NodeRunStore(values.run).latest();
    if (!found) throw new UsageError(`--run ${values.run}: no checkpoint yet`);
    decoder.useAdapter(new Map([...readSafetensors(found.weights).tensors].map(([n, t]) => [n, t.data])));
  }
  const stop = turnEndIds(tok);
  const stats = [];
  const V = bundle.manifest.model.vocab_size;
  const onLogits = values['logit-stats'] ? (logits) => stats.push(prompts.map((_, b) => {
    let max = -Infinity, sum = 0, sq = 0;
    for (const x of logits.subarray(b * V, (b + 1) * V)) { max = Math.max(max, x); sum += x; sq += x * x; }
    return [max, sum, sq];
  })) : undefined;
  const outs = await generate(decoder, prompts, sampling, stop, tok.padId ?? 0, { onLogits });
  if (values['logit-stats']) fs.writeFileSync(values['logit-stats'], JSON.stringify(stats));
  for (const ids of outs) {
    const text = tok.decode(ids, true);
    console.log(values.json ? JSON.stringify({ token_ids: ids, text }) : text);
  }
  return 0;
}

if (process.argv[1] && fs.realpathSync(process.argv[1]) === fs.realpathSync(fileURLToPath(import.meta.url))) {
  main(process.argv.slice(2)).then((code) => process.exit(code), (e) => {
    if (e instanceof UsageError || e instanceof RunError || e instanceof EngineError ||
        ['DataError', 'DecoderError'].includes(e?.constructor?.name)) {
      console.error(`error: ${e.message}`);
      process.exit(2);
    }
    if (e?.code === 'ENOENT' && e.path) {
      console.error(`error: ${e.path}: no such file`);
      process.exit(2);
    }
    console.error(e);
    process.exit(1);
  });
}
