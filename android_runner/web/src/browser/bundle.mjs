// The bundle, as `pocketlora web` serves it at /bundle/: the engine's reader {manifest, read(relPath)}, plus
// what the page needs besides: the manifest's own bytes (a run is keyed by their hash), its LoRA settings with
// Python's number types (for adapter_config.json), and the tokenizer files.
import { loads as pyJsonLoads } from '../data/pyjson.mjs';
import { TOKENIZER_FILES } from '../data/index.mjs';
import { sha256Hex } from './opfs_store.mjs';

export class BundleError extends Error {}

async function get(url) {
  let res;
  try {
    res = await fetch(url, { cache: 'no-store' });
  } catch (e) {
    throw new BundleError(`${url}: cannot fetch (${e.message}); is \`pocketlora web\` still running?`);
  }
  if (!res.ok) throw new BundleError(`${url}: HTTP ${res.status}`);
  return new Uint8Array(await res.arrayBuffer());
}

/** The bundle below `base` (default /bundle/): {manifest, manifestPy, sha256, read, tokenizerFiles()}. */
export async function openBundle(base = '/bundle/') {
  const raw = await get(base + 'manifest.json');
  const text = new TextDecoder().decode(raw);
  const manifest = JSON.parse(text);
  if (manifest.schema_version !== 1) {
    throw new BundleError(`manifest.json: schema_version ${manifest.schema_version} is not supported (reads 1)`);
  }
  const sizes = new Map(manifest.files.map((e) => [e.path, e.bytes]));
  const read = async (rel) => {
    const bytes = await get(base + rel.split('/').map(encodeURIComponent).join('/'));
    const want = sizes.get(rel);
    if (want !== undefined && bytes.length !== want) {
      throw new BundleError(`${rel}: ${bytes.length} bytes, the manifest says ${want}. Copy the bundle again.`);
    }
    return bytes;
  };
  return {
    manifest,
    manifestPy: pyJsonLoads(text),   // numbers as PyInt/PyFloat: 8.0 stays 8.0 when written back
    sha256: await sha256Hex(raw),    // the manifest lists every file's sha256: this names the whole bundle
    read,
    async tokenizerFiles() {
      const files = {};
      for (const e of manifest.files) {
        const name = e.path.split('/').at(-1);
        if (e.role === 'tokenizer' && TOKENIZER_FILES.includes(name)) files[name] = new TextDecoder().decode(await read(e.path));
      }
      return files;
    },
  };
}
