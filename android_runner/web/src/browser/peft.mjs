// The trained LoRA as a PEFT adapter: adapter_config.json + adapter_model.safetensors, byte for byte what
// ort_trainer/adapter.py's export_peft writes for the same tensors (tests/test_web_page.py compares):
//   - tensors renamed from ONNX names to PEFT keys and transposed where the manifest says `transposed`;
//   - safetensors as Python's `save_file(..., metadata={"format": "pt"})`: header {"__metadata__", then the
//     tensors sorted by name}, compact JSON padded with spaces to 8 bytes;
//   - the config as `json.dumps(adapter_config(manifest), indent=2) + "\n"` (Python's number and escape rules).
import { PyFloat, PyInt } from '../data/pystr.mjs';
import { floatRepr } from '../gate/pyfmt.mjs';

/** Python's json.dumps(s) of a str (ensure_ascii: everything outside space..~ escaped). */
function pyJsonString(s) {
  return JSON.stringify(s).replace(/[^\x20-\x7e]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

/** Python's json.dumps(v, indent=2) for JSON-like values (PyInt/PyFloat keep Python's int/float text). */
export function pyJsonDumps(v, indent = 2, level = 0) {
  const pad = (n) => '\n' + ' '.repeat(indent * n);
  if (v === null || v === undefined) return 'null';
  if (v === true) return 'true';
  if (v === false) return 'false';
  if (v instanceof PyInt) return v.toString();
  if (v instanceof PyFloat) {
    const x = v.valueOf();
    return Number.isNaN(x) ? 'NaN' : x === Infinity ? 'Infinity' : x === -Infinity ? '-Infinity' : floatRepr(x);
  }
  if (typeof v === 'number') return Number.isInteger(v) ? String(v) : floatRepr(v);
  if (typeof v === 'string') return pyJsonString(v);
  if (Array.isArray(v)) {
    if (!v.length) return '[]';
    return '[' + v.map((x) => pad(level + 1) + pyJsonDumps(x, indent, level + 1)).join(',') + pad(level) + ']';
  }
  const keys = Object.keys(v);
  if (!keys.length) return '{}';
  return '{' + keys.map((k) => `${pad(level + 1)}${pyJsonString(k)}: ${pyJsonDumps(v[k], indent, level + 1)}`).join(',') + pad(level) + '}';
}

/** ort_trainer.adapter.adapter_config, from the manifest as Python read it (manifestPy: pyjson values). */
export function adapterConfig(manifestPy) {
  const lora = manifestPy.lora;
  return {
    peft_type: 'LORA',
    task_type: 'CAUSAL_LM',
    base_model_name_or_path: manifestPy.model.source,
    r: lora.r,
    lora_alpha: lora.alpha,
    lora_dropout: lora.dropout,
    target_modules: lora.target_modules,
    fan_in_fan_out: lora.fan_in_fan_out,
    bias: 'none',
    inference_mode: true,
    init_lora_weights: true,
    use_rslora: false,
    use_dora: false,
    modules_to_save: null,
  };
}

/** ort_trainer.adapter.to_peft: [[peft_key, shape, Float32Array], ...] from LoRA tensors by ONNX name. */
export function toPeft(manifest, lora) {
  return manifest.trainable.map((t) => {
    const data = lora.get(t.onnx_name);
    if (!data) throw new Error(`the checkpoint has no ${t.onnx_name}`);
    if (!t.transposed) return [t.peft_key, t.shape, data];
    if (t.shape.length !== 2) throw new Error(`${t.onnx_name}: can only transpose 2-D tensors, not ${t.shape}`);
    const [rows, cols] = t.shape;
    const out = new Float32Array(data.length);
    for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) out[j * rows + i] = data[i * cols + j];
    return [t.peft_key, [cols, rows], out];
  });
}

/** safetensors' serialize (all F32): metadata first, tensors sorted by name, header padded to 8 bytes. */
export function pythonSafetensors(entries, metadata) {
  const sorted = [...entries].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  let header = `{"__metadata__":${JSON.stringify(metadata)}`;
  let offset = 0;
  for (const [name, shape, data] of sorted) {
    header += `,${JSON.stringify(name)}:{"dtype":"F32","shape":${JSON.stringify(shape)},"data_offsets":[${offset},${offset + data.byteLength}]}`;
    offset += data.byteLength;
  }
  header += '}';
  header += ' '.repeat((8 - (new TextEncoder().encode(header).length % 8)) % 8);
  const head = new TextEncoder().encode(header);
  const out = new Uint8Array(8 + head.length + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(head.length), true);
  out.set(head, 8);
  let at = 8 + head.length;
  for (const [, , data] of sorted) {
    out.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength), at);
    at += data.byteLength;
  }
  return out;
}

/** {"adapter_config.json": bytes, "adapter_model.safetensors": bytes} for LoRA tensors by ONNX name (a Map). */
export function peftFiles(bundle, lora) {
  return {
    'adapter_config.json': new TextEncoder().encode(pyJsonDumps(adapterConfig(bundle.manifestPy)) + '\n'),
    'adapter_model.safetensors': pythonSafetensors(toPeft(bundle.manifest, lora), { format: 'pt' }),
  };
}
