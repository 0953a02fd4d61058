// safetensors, float32 only: an 8-byte little-endian header length, a JSON header
// {name: {dtype: "F32", shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the bytes.
// Readable by Python's `safetensors.numpy.load_file` (and written the same way by artifacts_gen/web_graphs.py).

const enc = new TextEncoder();
const dec = new TextDecoder();

/** bytes (Uint8Array) -> {tensors: Map name -> {shape, data: Float32Array (a copy)}, metadata} */
export function readSafetensors(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const n = Number(view.getBigUint64(0, true));
  if (8 + n > bytes.byteLength) throw new Error(`safetensors: header of ${n} bytes in a ${bytes.byteLength}-byte file (truncated)`);
  const header = JSON.parse(dec.decode(bytes.subarray(8, 8 + n)));
  const base = 8 + n;
  const tensors = new Map();
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    if (info.dtype !== 'F32') throw new Error(`safetensors: ${name} is ${info.dtype}; only F32 is supported`);
    const [b, e] = info.data_offsets;
    const count = info.shape.reduce((a, d) => a * d, 1);
    if (e - b !== 4 * count || base + e > bytes.byteLength) throw new Error(`safetensors: ${name}: bad data offsets`);
    const data = new Float32Array(count);
    new Uint8Array(data.buffer).set(bytes.subarray(base + b, base + e));   // copy: aligned, little-endian hosts
    tensors.set(name, { shape: info.shape, data });
  }
  return { tensors, metadata: header.__metadata__ ?? {} };
}

/** entries: [[name, shape, Float32Array], ...], metadata {str: str} -> Uint8Array */
export function writeSafetensors(entries, metadata = {}) {
  const header = {};
  let offset = 0;
  for (const [name, shape, data] of entries) {
    header[name] = { dtype: 'F32', shape, data_offsets: [offset, offset + data.byteLength] };
    offset += data.byteLength;
  }
  if (Object.keys(metadata).length) header.__metadata__ = Object.fromEntries(Object.entries(metadata).map(([k, v]) => [k, String(v)]));
  let raw = enc.encode(JSON.stringify(header));
  const pad = (8 - (raw.length % 8)) % 8;
  if (pad) raw = enc.encode(JSON.stringify(header) + ' '.repeat(pad));
  const out = new Uint8Array(8 + raw.length + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(raw.length), true);
  out.set(raw, 8);
  let at = 8 + raw.length;
  for (const [, , data] of entries) {
    out.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength), at);
    at += data.byteLength;
  }
  return out;
}
