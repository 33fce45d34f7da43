//! A seeded, bounded input fuzzer for the property tests (issue 15): a
//! splitmix64 generator, interesting tokens, and mutations of text and of
//! JSON values. No dependency; a failure prints the seed and the input.

/// splitmix64: small, fast, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// In `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True `percent` times in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Values that break parsers: empty, signs, overflows, wrong types, bad
/// addresses and CIDRs, YAML syntax, control and non-ASCII characters.
pub const TOKENS: &[&str] = &[
    "",
    "-1",
    "0",
    "65536",
    "4294967296",
    "99999999999999999999999",
    "1.5",
    "1e309",
    "NaN",
    "null",
    "~",
    "true",
    "yes",
    "198.18.0.1",
    "198.18.0.256",
    "198.18.0.1/33",
    "198.18.0.0/15",
    "0198.018.0.1",
    "::1",
    "fe80::1%eth0",
    "TCP",
    "SCTP",
    "ICMP",
    "Local",
    "Cluster",
    "ClientIP",
    "maglev",
    "1h",
    "-5s",
    "\u{e9}\u{1f980}",
    "\u{0}",
    "\t",
    "{",
    "}",
    "[",
    "]",
    ": ",
    "- ",
    "&a ",
    "*a",
    "!!binary ",
    "!!int ",
    "? ",
    "|",
    ">",
    "'",
    "\"",
    "#",
    "%YAML 1.2",
    "<<: *a",
    "\n",
    "\n  ",
];

/// A random string: a token, a few tokens, or a long run.
pub fn random_string(rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => "a".repeat(rng.below(5000)),
        1 => (0..rng.below(4) + 2).map(|_| *rng.pick(TOKENS)).collect(),
        _ => rng.pick(TOKENS).to_string(),
    }
}

/// `text` mutated a few times: bytes flipped, ranges deleted, duplicated or
/// truncated, tokens inserted. Valid UTF-8 (lossy), ends with a newline.
pub fn mutate_text(rng: &mut Rng, text: &str) -> String {
    let mut b = text.as_bytes().to_vec();
    for _ in 0..rng.below(4) + 1 {
        let len = b.len().max(1);
        let at = rng.below(len).min(b.len());
        match rng.below(6) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 => {
                let end = (at + rng.below(32)).min(b.len());
                b.drain(at..end);
            }
            2 => {
                let end = (at + rng.below(64)).min(b.len());
                let chunk = b[at..end].to_vec();
                b.splice(at..at, chunk);
            }
            3 => b.truncate(at),
            _ => {
                let t = random_string(rng);
                b.splice(at..at, t.into_bytes());
            }
        }
    }
    let mut s = String::from_utf8_lossy(&b).into_owned();
    s.push('\n');
    s
}

/// A random JSON value, nested at most `depth` deep.
pub fn random_value(rng: &mut Rng, depth: usize) -> serde_json::Value {
    use serde_json::Value;
    match rng.below(if depth == 0 { 5 } else { 7 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => serde_json::json!(*rng.pick(&[
            0i64,
            -1,
            1,
            80,
            65535,
            65536,
            i64::MAX,
            i64::MIN,
            u32::MAX as i64
        ])),
        3 => serde_json::json!(1.5e300),
        4 => Value::String(random_string(rng)),
        5 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth - 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.below(4))
                .map(|_| (random_string(rng), random_value(rng, depth - 1)))
                .collect(),
        ),
    }
}

/// `v` with a few nodes replaced by random values, removed, or their
/// strings mutated.
pub fn mutate_value(rng: &mut Rng, v: &mut serde_json::Value) {
    for _ in 0..rng.below(3) + 1 {
        mutate_one(rng, v);
    }
}

fn mutate_one(rng: &mut Rng, v: &mut serde_json::Value) {
    use serde_json::Value;
    // Walk down a random path, stopping at random.
    let children = match v {
        Value::Object(m) => m.len(),
        Value::Array(a) => a.len(),
        _ => 0,
    };
    if children > 0 && rng.below(4) != 0 {
        let i = rng.below(children);
        match v {
            Value::Object(m) => {
                if rng.below(8) == 0 {
                    let k = m.keys().nth(i).cloned().unwrap();
                    m.remove(&k);
                    return;
                }
                let child = m.values_mut().nth(i).unwrap();
                return mutate_one(rng, child);
            }
            Value::Array(a) => {
                if rng.below(8) == 0 {
                    let c = a[i].clone();
                    a.push(c);
                    return;
                }
                return mutate_one(rng, &mut a[i]);
            }
            _ => unreachable!(),
        }
    }
    *v = match v {
        Value::String(s) if rng.below(2) == 0 => Value::String(mutate_text(rng, s)),
        _ => random_value(rng, 2),
    };
}
