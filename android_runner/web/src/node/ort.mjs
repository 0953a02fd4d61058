// onnxruntime-web's training build in Node. The package maps "./training" to null for Node (browser-only),
// but the dist file imports fine by path; the .wasm is located through env.wasm.wasmPaths.
import { createRequire } from 'node:module';
import v8 from 'node:v8';
import vm from 'node:vm';
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

/** threads: WASM threads (worker_threads in Node); 0: onnxruntime-web's default. */
export async function loadOrt({ threads = 0 } = {}) {
  const require = createRequire(import.meta.url);
  let dir = path.dirname(require.resolve('onnxruntime-web'));   // <pkg>/dist/ort.node.min.js; ./package.json is not exported
  while (!fs.existsSync(path.join(dir, 'package.json'))) dir = path.dirname(dir);
  const dist = path.join(dir, 'dist');
  const ort = await import(pathToFileURL(path.join(dist, 'ort.training.wasm.min.mjs')).href);
  ort.env.wasm.wasmPaths = dist + path.sep;
  if (threads > 0) ort.env.wasm.numThreads = threads;
  ort.env.logLevel = 'error';
  return ort;
}

/** A full garbage collection now (V8's gc(), exposed at run time). The engine calls it once the session holds the
 * weights, so that the shards' JS copies are freed before the first step grows the WASM heap. */
export function collectGarbage() {
  v8.setFlagsFromString('--expose_gc');
  vm.runInNewContext('gc')();
}
