// numpy's default generator, bit-exact: np.random.default_rng(entropy) = Generator(PCG64(SeedSequence(entropy))),
// and Generator.permutation(n) (np.arange(n) shuffled by Fisher-Yates, j = random_interval(i)).
// Only what DataOrder needs. 128-bit arithmetic in BigInt.
//
// numpy sources mirrored: numpy/random/bit_generator.pyx (SeedSequence: pool of 4 uint32 mixed with
// hashmix/mix, generate_state), numpy/random/_pcg64.pyx + src/pcg64 (PCG64 XSL-RR 128/64: seed from
// generate_state(4, uint64): state = words[0]<<64 | words[1], inc = words[2]<<64 | words[3]; srandom:
// state=0, inc=(initseq<<1)|1, step, state+=initstate, step; output after each step; next_uint32 hands
// out the low half then the buffered high half of one 64-bit draw), numpy/random/src/distributions
// (random_interval: mask rejection, 32-bit draws when max <= 0xffffffff), _generator.pyx (shuffle of a
// 1-d array: for i in n-1..1: j = random_interval(i); swap).

const M32 = 0xffffffffn;
const M64 = (1n << 64n) - 1n;
const M128 = (1n << 128n) - 1n;
const PCG_MULT = 0x2360ed051fc65da44385df649fccf645n;

const INIT_A = 0x43b0d7e5;
const MULT_A = 0x931e8875;
const INIT_B = 0x8b51f9dd;
const MULT_B = 0x58f38ded;
const MIX_MULT_L = 0xca01f9dd;
const MIX_MULT_R = 0x4973f715;
const POOL_SIZE = 4;

const u32 = (x) => x >>> 0;
const mul32 = (a, b) => Math.imul(a, b) >>> 0;

/** numpy's _coerce_to_uint32_array for a non-negative int or a sequence of them. */
function toUint32Words(x) {
  if (Array.isArray(x)) return x.flatMap(toUint32Words);
  let n = BigInt(x);
  if (n < 0n) throw new RangeError("expected non-negative integer");
  if (n === 0n) return [0];
  const out = [];
  while (n > 0n) {
    out.push(Number(n & M32));
    n >>= 32n;
  }
  return out;
}

export class SeedSequence {
  constructor(entropy) {
    const words = toUint32Words(entropy);
    const pool = new Array(POOL_SIZE).fill(0);
    let hashConst = INIT_A;
    const hashmix = (value) => {
      value = u32(value ^ hashConst);
      hashConst = mul32(hashConst, MULT_A);
      value = mul32(value, hashConst);
      return u32(value ^ (value >>> 16));
    };
    const mix = (x, y) => {
      const r = u32(mul32(MIX_MULT_L, x) - mul32(MIX_MULT_R, y));
      return u32(r ^ (r >>> 16));
    };
    for (let i = 0; i < POOL_SIZE; i++) pool[i] = hashmix(i < words.length ? words[i] : 0);
    for (let s = 0; s < POOL_SIZE; s++) {
      for (let d = 0; d < POOL_SIZE; d++) if (s !== d) pool[d] = mix(pool[d], hashmix(pool[s]));
    }
    for (let s = POOL_SIZE; s < words.length; s++) {
      for (let d = 0; d < POOL_SIZE; d++) pool[d] = mix(pool[d], hashmix(words[s]));
    }
    this.pool = pool;
  }

  /** generate_state(n, uint32) as numbers. */
  generateState32(nWords) {
    let hashConst = INIT_B;
    const out = [];
    for (let i = 0; i < nWords; i++) {
      let v = u32(this.pool[i % POOL_SIZE] ^ hashConst);
      hashConst = mul32(hashConst, MULT_B);
      v = mul32(v, hashConst);
      out.push(u32(v ^ (v >>> 16)));
    }
    return out;
  }

  /** generate_state(n, uint64) as BigInts (pairs of uint32, little-endian). */
  generateState64(nWords) {
    const w = this.generateState32(2 * nWords);
    const out = [];
    for (let i = 0; i < nWords; i++) out.push(BigInt(w[2 * i]) | (BigInt(w[2 * i + 1]) << 32n));
    return out;
  }
}

export class PCG64 {
  constructor(seedSequence) {
    const [s0, s1, i0, i1] = seedSequence.generateState64(4);
    const initstate = (s0 << 64n) | s1;
    const initseq = (i0 << 64n) | i1;
    this.inc = ((initseq << 1n) | 1n) & M128;
    this.state = 0n;
    this._step();
    this.state = (this.state + initstate) & M128;
    this._step();
    this.hasUint32 = false;
    this.uinteger = 0;
  }

  _step() {
    this.state = (this.state * PCG_MULT + this.inc) & M128;
  }

  /** next 64-bit output (BigInt) */
  nextUint64() {
    this._step();
    const s = this.state;
    const x = ((s >> 64n) ^ s) & M64;
    const rot = s >> 122n;
    return ((x >> rot) | (x << ((64n - rot) & 63n))) & M64;
  }

  /** next 32-bit output (number): low half of a 64-bit draw, then its high half */
  nextUint32() {
    if (this.hasUint32) {
      this.hasUint32 = false;
      return this.uinteger;
    }
    const next = this.nextUint64();
    this.hasUint32 = true;
    this.uinteger = Number(next >> 32n);
    return Number(next & M32);
  }
}

export class Generator {
  constructor(bitGenerator) {
    this.bitGenerator = bitGenerator;
  }

  /** numpy random_interval: uniform integer in [0, max]. */
  randomInterval(max) {
    if (max === 0) return 0;
    if (max <= 0xffffffff) {
      let mask = max;
      mask |= mask >>> 1;
      mask |= mask >>> 2;
      mask |= mask >>> 4;
      mask |= mask >>> 8;
      mask |= mask >>> 16;
      mask >>>= 0;
      let value;
      do {
        value = (this.bitGenerator.nextUint32() & mask) >>> 0;
      } while (value > max);
      return value;
    }
    let m = BigInt(max);
    for (let k = 1n; k <= 32n; k <<= 1n) m |= m >> k;
    let value;
    do {
      value = this.bitGenerator.nextUint64() & m;
    } while (value > BigInt(max));
    return Number(value);
  }

  /** Generator.permutation(n) for an int n: Int32Array (n < 2**31). */
  permutation(n) {
    const arr = new Int32Array(n);
    for (let i = 0; i < n; i++) arr[i] = i;
    for (let i = n - 1; i >= 1; i--) {
      const j = this.randomInterval(i);
      const t = arr[i];
      arr[i] = arr[j];
      arr[j] = t;
    }
    return arr;
  }
}

/** np.random.default_rng(entropy) where entropy is a non-negative int or a list of them. */
export function defaultRng(entropy) {
  return new Generator(new PCG64(new SeedSequence(entropy)));
}
