// Error classes mirroring ort_trainer/data.py: DataError is a ValueError (Python: class DataError(ValueError)).

/** Python's ValueError: a bad argument (e.g. batch_size < 1). */
export class ValueError extends Error {
  constructor(message) {
    super(message);
    this.name = "ValueError";
  }
}

/** Unusable training data; the one-line message names the file, the line (1-based) when there is
 * one, the problem and the fix — the same text as the Python side's DataError. */
export class DataError extends ValueError {
  constructor(message) {
    super(message);
    this.name = "DataError";
  }
}
