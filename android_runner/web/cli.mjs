#!/usr/bin/env node
// pocketlora-web: the phone runner's training loop on Node (onnxruntime-web WASM).
//
//   node cli.mjs train --bundle B --data D --out R (--max-steps N | --epochs N) [--micro-batch 1 --accum 8
//        --lr 2e-4 --warmup 10 --schedule cosine --clip 1.0 --weight-decay 0 --seed 0 --save-every 50 --threads 1]
//
// Flags and defaults are `pocketlora train`'s. Running the same command again on an existing --out resumes
// from its last good checkpoint; SIGTERM/SIGINT finish the micro-batch, checkpoint and exit 0. Known,
// user-fixable errors print one line and exit 2. The run directory is read by `pocketlora export --run R`.
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

import { loadOrt } from './src/node/ort.mjs';
import { NodeRunStore, openBundleDir } from './src/node/store.mjs';
import { FORMAT as PRETOKENIZED, PretokenizedSource } from './src/pretokenized.mjs';
import { DEFAULTS, RunError, train } from './src/runner.mjs';
import { EngineError } from './src/engine.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));

const TRAIN_FLAGS = {
  bundle: { type: 'string' }, data: { type: 'string' }, out: { type: 'string' },
  epochs: { type: 'string' }, 'max-steps': { type: 'string' },
  'micro-batch': { type: 'string' }, accum: { type: 'string' }, lr: { type: 'string' }, warmup: { type: 'string' },
  schedule: { type: 'string' }, clip: { type: 'string' }, 'weight-decay': { type: 'string' }, seed: { type: 'string' },
  'group-by-length': { type: 'boolean' }, 'save-every': { type: 'string' }, threads: { type: 'string' },
  help: { type: 'boolean', short: 'h' },
};

class UsageError extends Error {}

function number(name, text, integer) {
  if (text === undefined) return undefined;
  const v = Number(text);
  if (text.trim() === '' || !Number.isFinite(v) || (integer && !Number.isInteger(v))) {
    throw new UsageError(`--${name}: invalid ${integer ? 'int' : 'float'} value: '${text}'`);
  }
  return v;
}

export function parseTrainArgs(argv) {
  let values;
  try {
    ({ values } = parseArgs({ args: argv, options: TRAIN_FLAGS, strict: true, allowPositionals: false }));
  } catch (e) {
    throw new UsageError(e.message);
  }
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
    },
  };
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
  '[--lr F] [--warmup N] [--schedule cosine|linear|constant] [--clip F] [--weight-decay F] [--seed N] [--save-every N] [--threads N]';

async function main(argv) {
  const [verb, ...rest] = argv;
  if (verb !== 'train') throw new UsageError(USAGE);
  const args = parseTrainArgs(rest);
  if (args.help) { console.log(USAGE); return 0; }
  const { cfg, out } = args;

  let stopSignal = null;
  for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => { stopSignal = sig; });

  const bundle = await openBundleDir(cfg.bundle);
  const data = await openData(cfg, bundle);
  const ort = await loadOrt({ threads: cfg.threads });
  await train(cfg, {
    ort, bundle, data, store: new NodeRunStore(out),
    shouldStop: () => stopSignal !== null, stopReason: () => stopSignal,
    log: (m) => console.error(m),
  });
  return 0;
}

if (process.argv[1] && fs.realpathSync(process.argv[1]) === fs.realpathSync(fileURLToPath(import.meta.url))) {
  main(process.argv.slice(2)).then((code) => process.exit(code), (e) => {
    if (e instanceof UsageError || e instanceof RunError || e instanceof EngineError || e?.constructor?.name === 'DataError') {
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
