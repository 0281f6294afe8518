//! What decoding a pickle would cost, found without decoding it. The pickle decoder
//! (serde-pickle) builds and drops values recursively, so a small hostile file of nested
//! lists (`]]]]…aaaa.`, two bytes a level) overflows the stack and aborts the process; it
//! copies a memoized value at every reference to it, so a file that references one large
//! list many times (or a list that holds the previous one twice, n times over) decodes to
//! far more elements than it has bytes; it parses decimal integers in quadratic time; and
//! it gives every open MARK a stack of its own (128 slots). A PyTorch memory snapshot nests
//! a handful of levels, writes short integers and references small frame records; this
//! runs the pickle's opcodes over container ids instead of values, records which container
//! holds which, and measures the longest chain and the elements the decoded value expands
//! to, so that the replay can refuse a file before decoding it. It also counts the entries
//! of the lists stored under the key `device_traces` (memo references in full): the replay
//! keeps one per reference, so that a file of one memoized entry referenced millions of
//! times, within the elements allowed for its size, is refused before it is decoded.

use std::collections::HashMap;

/// Longest integer argument read, in digits (INT, LONG) or bytes (LONG1, LONG4); also the
/// longest FLOAT. The decoder parses a LONG's digits in quadratic time; a snapshot's
/// integers (addresses, sizes, times) have at most 20 digits.
pub(super) const MAX_NUMBER_LEN: usize = 64;

/// Most MARKs open at once: the decoder gives each a stack of 128 slots. A pickler opens
/// one per container being written, so this is far deeper than a snapshot nests.
pub(super) const MAX_OPEN_MARKS: usize = 1024;

/// What a pickle stack slot holds: a mark, a scalar (with what it weighs: see
/// `scalar_weight`), the text `device_traces` (a scalar of weight 1 that, as a dict key,
/// makes its value the snapshot's device traces), or container `id`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Mark,
    Scalar(u32),
    DeviceTracesKey,
    Node(u32),
}

/// The key whose value the replay decodes (`snapshot::Top`).
const DEVICE_TRACES: &[u8] = b"device_traces";

/// A text scalar of these bytes (as written: UTF-8, or raw-unicode-escape for UNICODE).
fn text(bytes: &[u8]) -> Slot {
    match bytes {
        DEVICE_TRACES => Slot::DeviceTracesKey,
        _ => scalar_weight(bytes.len() as u64),
    }
}

/// A scalar counts one element, plus one per 64 bytes of text it carries (each reference
/// to a memoized string copies it).
fn scalar_weight(bytes: u64) -> Slot {
    Slot::Scalar(u32::try_from(1 + bytes / 64).unwrap_or(u32::MAX))
}

const SCALAR: Slot = Slot::Scalar(1);

/// Containers, what each holds (ids), the weight of the scalars each holds and how many
/// items (containers and scalars, per reference); the nesting depth is the longest chain, a
/// container's elements are its own (itself and its scalars) plus those of every container
/// it holds, once per reference. `device_traces`: the containers set as a dict's value under
/// that key, once per setting.
#[derive(Default)]
struct Graph {
    children: Vec<Vec<u32>>,
    own: Vec<u64>,
    items: Vec<u64>,
    device_traces: Vec<u32>,
}

/// The shape of a decoded pickle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    /// The deepest nesting of containers (lists, dicts, tuples, sets, objects).
    pub depth: usize,
    /// The elements (containers and scalars, memo references counted in full) of the value
    /// the pickle decodes to, saturating.
    pub elements: u64,
    /// The containers held by a container set under the key `device_traces` (a snapshot's
    /// per-device lists) and their items (the entries), memo references counted in full,
    /// saturating: what the replay keeps, one per list or entry. Only the key as picklers
    /// write it counts (one text opcode, no escapes).
    pub trace_entries: u64,
}

impl Graph {
    fn node(&mut self, holds: impl IntoIterator<Item = Slot>) -> Slot {
        let id = self.children.len() as u32;
        self.children.push(Vec::new());
        self.own.push(1);
        self.items.push(0);
        self.hold(Slot::Node(id), holds);
        Slot::Node(id)
    }

    fn hold(&mut self, parent: Slot, items: impl IntoIterator<Item = Slot>) {
        let Slot::Node(p) = parent else { return };
        for item in items {
            if item != Slot::Mark {
                let count = &mut self.items[p as usize];
                *count = count.saturating_add(1);
            }
            match item {
                Slot::Node(c) => self.children[p as usize].push(c),
                Slot::Scalar(w) => {
                    let own = &mut self.own[p as usize];
                    *own = own.saturating_add(w as u64);
                }
                Slot::DeviceTracesKey => {
                    let own = &mut self.own[p as usize];
                    *own = own.saturating_add(1);
                }
                Slot::Mark => {}
            }
        }
    }

    /// Notes the containers set under the key `device_traces` among (key, value) pairs.
    fn note_pairs(&mut self, pairs: impl IntoIterator<Item = (Slot, Slot)>) {
        for (key, value) in pairs {
            if let (Slot::DeviceTracesKey, Slot::Node(id)) = (key, value) {
                self.device_traces.push(id);
            }
        }
    }

    /// The containers a `device_traces` container holds and their items, per reference (a
    /// device's list is kept as an entry is: millions of empty lists must count too).
    /// Each distinct container's total is summed once and weighed by how often it was set:
    /// one container of many children set many times (a few KB of memo references) must not
    /// cost their product here, before any limit can refuse the file.
    fn trace_entries(&self) -> u64 {
        let mut settings: HashMap<u32, u64> = HashMap::new();
        for &id in &self.device_traces {
            *settings.entry(id).or_default() += 1;
        }
        settings.into_iter().fold(0u64, |sum, (id, times)| {
            let per_setting = self.children[id as usize].iter().fold(0u64, |n, &trace| {
                n.saturating_add(1 + self.items[trace as usize])
            });
            sum.saturating_add(per_setting.saturating_mul(times))
        })
    }

    /// The longest chain of containers and each container's elements, iteratively (a cycle,
    /// which the decoder replaces by None, ends a chain and counts one element).
    fn measure(&self) -> (usize, Vec<u64>) {
        const NEW: u32 = 0;
        const OPEN: u32 = 1;
        let mut depth = vec![NEW; self.children.len()];
        let mut elements = vec![1u64; self.children.len()];
        let mut deepest = 0;
        for root in 0..self.children.len() {
            if depth[root] != NEW {
                continue;
            }
            // (node, next child to visit); OPEN marks nodes on the path (depth 0 for cycles).
            let mut path = vec![(root, 0usize)];
            depth[root] = OPEN;
            while let Some(&mut (node, ref mut next)) = path.last_mut() {
                if let Some(&child) = self.children[node].get(*next) {
                    *next += 1;
                    if depth[child as usize] == NEW {
                        depth[child as usize] = OPEN;
                        path.push((child as usize, 0));
                    }
                    continue;
                }
                // Depths are stored plus one, so that NEW and OPEN stay apart from them.
                let below = self.children[node]
                    .iter()
                    .map(|&c| depth[c as usize].saturating_sub(1))
                    .max()
                    .unwrap_or(0);
                depth[node] = below + 2;
                deepest = deepest.max(below as usize + 1);
                elements[node] = self.children[node].iter().fold(self.own[node], |sum, &c| {
                    sum.saturating_add(elements[c as usize])
                });
                path.pop();
            }
        }
        (deepest, elements)
    }
}

/// The pickle's bytes, read forward.
struct Reader<'a> {
    raw: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.raw.len());
        let end = end.ok_or_else(|| "truncated pickle".to_string())?;
        let bytes = &self.raw[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    /// A newline-terminated argument, without its newline.
    fn line(&mut self) -> Result<&'a [u8], String> {
        let len = self.raw[self.at..]
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("truncated pickle")?;
        Ok(&self.take(len + 1)?[..len])
    }

    /// A little-endian count of `width` bytes.
    fn count(&mut self, width: usize) -> Result<u64, String> {
        let bytes = self.take(width)?;
        Ok(bytes.iter().rev().fold(0u64, |v, &b| (v << 8) | b as u64))
    }

    fn decimal(&mut self) -> Result<u64, String> {
        std::str::from_utf8(self.line()?)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .ok_or_else(|| "bad memo index".to_string())
    }
}

/// The shape of the value the pickle decodes to, or why it is not read (the decoder would
/// refuse it too, or it holds a number longer than `MAX_NUMBER_LEN` or more than
/// `MAX_OPEN_MARKS` marks open at once).
pub(super) fn scan(raw: &[u8]) -> Result<Shape, String> {
    let mut r = Reader { raw, at: 0 };
    let mut graph = Graph::default();
    let mut stack: Vec<Slot> = Vec::new();
    let mut memo: HashMap<u64, Slot> = HashMap::new();
    let malformed = || "malformed pickle (stack underflow)".to_string();
    let pop = |stack: &mut Vec<Slot>| match stack.pop() {
        Some(Slot::Mark) | None => Err(malformed()),
        Some(slot) => Ok(slot),
    };
    // The decoder keeps the items above a mark on a stack of their own: a mark is never the
    // top item it reads.
    let top = |stack: &[Slot]| match stack.last() {
        Some(Slot::Mark) | None => Err(malformed()),
        Some(&slot) => Ok(slot),
    };
    let mut open_marks = 0usize;
    // Where the topmost mark is, closed: the caller takes the items above it (drained, not
    // copied: one APPENDS may take most of the stack), then truncates the stack to it.
    let to_mark = |stack: &[Slot], open_marks: &mut usize| {
        let mark = stack
            .iter()
            .rposition(|s| *s == Slot::Mark)
            .ok_or("malformed pickle (no mark)")?;
        *open_marks = open_marks.saturating_sub(1);
        Ok::<_, String>(mark)
    };
    loop {
        let op = r.take(1)?[0];
        match op {
            b'.' => break, // STOP
            b'(' => {
                open_marks += 1;
                if open_marks > MAX_OPEN_MARKS {
                    return Err(format!(
                        "more than {MAX_OPEN_MARKS} marks open at once (a snapshot opens a few)"
                    ));
                }
                stack.push(Slot::Mark);
            }
            // Arguments only: protocol, frame.
            0x80 => drop(r.take(1)?),
            0x95 => drop(r.take(8)?),
            // Numbers with a newline-terminated argument: INT, LONG, FLOAT.
            b'I' | b'L' | b'F' => {
                let text = r.line()?;
                if text.len() > MAX_NUMBER_LEN + 1 {
                    return Err(too_long(text.len()));
                }
                stack.push(SCALAR);
            }
            // Text with a newline-terminated argument: STRING, UNICODE.
            b'S' | b'V' => {
                let line = r.line()?;
                stack.push(match op {
                    b'V' => text(line),
                    _ => scalar_weight(line.len() as u64),
                });
            }
            // Fixed-size scalars: BININT, BININT1, BININT2, BINFLOAT; None, True, False.
            b'J' | b'K' | b'M' | b'G' => {
                r.take(match op {
                    b'J' => 4,
                    b'K' => 1,
                    b'M' => 2,
                    _ => 8,
                })?;
                stack.push(SCALAR);
            }
            b'N' | 0x88 | 0x89 => stack.push(SCALAR),
            // Counted scalars: LONG1, SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE (1-byte
            // length); LONG4, BINSTRING, BINUNICODE, BINBYTES (4); BINUNICODE8, BINBYTES8,
            // BYTEARRAY8 (8).
            0x8a | b'U' | b'C' | 0x8c | 0x8b | b'T' | b'X' | b'B' | 0x8d | 0x8e | 0x96 => {
                let width = match op {
                    0x8a | b'U' | b'C' | 0x8c => 1,
                    0x8b | b'T' | b'X' | b'B' => 4,
                    _ => 8,
                };
                let len = r.count(width)?;
                if matches!(op, 0x8a | 0x8b) && len > MAX_NUMBER_LEN as u64 {
                    return Err(too_long(len as usize));
                }
                let bytes = r.take(usize::try_from(len).map_err(|_| "truncated pickle")?)?;
                // Only unicode opcodes decode to a str, which the replay's key must be.
                stack.push(match op {
                    b'X' | 0x8c | 0x8d => text(bytes),
                    _ => scalar_weight(len),
                });
            }
            // Empty containers: list, dict, tuple, set.
            b']' | b'}' | b')' | 0x8f => {
                let node = graph.node([]);
                stack.push(node);
            }
            // Containers built from the items above the mark: LIST, DICT, TUPLE, FROZENSET,
            // OBJ; INST (with two newline-terminated names).
            b'l' | b'd' | b't' | 0x91 | b'o' | b'i' => {
                if op == b'i' {
                    r.line()?;
                    r.line()?;
                }
                let mark = to_mark(&stack, &mut open_marks)?;
                if op == b'd' {
                    graph.note_pairs(pairs(&stack[mark + 1..]));
                }
                let node = graph.node(stack.drain(mark + 1..));
                stack.truncate(mark);
                stack.push(node);
            }
            // TUPLE1-3, REDUCE (callable, args), NEWOBJ (cls, args), NEWOBJ_EX (3).
            0x85..=0x87 | b'R' | 0x81 | 0x92 => {
                let n = match op {
                    0x85 => 1,
                    0x86 | b'R' | 0x81 => 2,
                    _ => 3,
                };
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(pop(&mut stack)?);
                }
                let node = graph.node(items);
                stack.push(node);
            }
            // Into the container below: APPEND, SETITEM (key and value), BUILD (state).
            b'a' | b'b' | b's' => {
                let n = if op == b's' { 2 } else { 1 };
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(pop(&mut stack)?);
                }
                if op == b's' {
                    // Popped value first.
                    graph.note_pairs([(items[1], items[0])]);
                }
                let parent = *stack.last().ok_or_else(malformed)?;
                let parent = match parent {
                    // BUILD on an unresolved global (a scalar here) makes an object.
                    Slot::Scalar(_) | Slot::DeviceTracesKey => {
                        let node = graph.node([]);
                        *stack.last_mut().expect("checked") = node;
                        node
                    }
                    Slot::Mark => return Err(malformed()),
                    node => node,
                };
                graph.hold(parent, items);
            }
            // Into the container below the mark: APPENDS, SETITEMS, ADDITEMS.
            b'e' | b'u' | 0x90 => {
                let mark = to_mark(&stack, &mut open_marks)?;
                if op == b'u' {
                    graph.note_pairs(pairs(&stack[mark + 1..]));
                }
                let parent = top(&stack[..mark])?;
                graph.hold(parent, stack.drain(mark + 1..));
                stack.truncate(mark);
            }
            // GLOBAL (two newline-terminated names), STACK_GLOBAL (two names on the stack).
            b'c' => {
                r.line()?;
                r.line()?;
                stack.push(SCALAR);
            }
            0x93 => {
                pop(&mut stack)?;
                pop(&mut stack)?;
                stack.push(SCALAR);
            }
            b'0' => drop(pop(&mut stack)?),
            b'1' => stack.truncate(to_mark(&stack, &mut open_marks)?),
            b'2' => stack.push(top(&stack)?),
            // Memo: PUT (decimal line), BINPUT (1 byte), LONG_BINPUT (4), MEMOIZE.
            b'p' | b'q' | b'r' | 0x94 => {
                let index = match op {
                    b'p' => r.decimal()?,
                    b'q' => r.count(1)?,
                    b'r' => r.count(4)?,
                    _ => memo.len() as u64,
                };
                memo.insert(index, top(&stack)?);
            }
            // GET (decimal line), BINGET (1 byte), LONG_BINGET (4).
            b'g' | b'h' | b'j' => {
                let index = match op {
                    b'g' => r.decimal()?,
                    b'h' => r.count(1)?,
                    _ => r.count(4)?,
                };
                stack.push(memo.get(&index).copied().unwrap_or(SCALAR));
            }
            other => return Err(format!("pickle opcode {other:#04x} is not supported")),
        }
    }
    let (depth, elements) = graph.measure();
    let elements = match stack.last() {
        Some(Slot::Node(id)) => elements[*id as usize],
        Some(Slot::Scalar(w)) => *w as u64,
        Some(Slot::DeviceTracesKey) => 1,
        _ => 0,
    };
    Ok(Shape {
        depth,
        elements,
        trace_entries: graph.trace_entries(),
    })
}

/// The (key, value) pairs of a dict's items, as DICT and SETITEMS take them.
fn pairs(items: &[Slot]) -> impl Iterator<Item = (Slot, Slot)> + '_ {
    items.chunks_exact(2).map(|pair| (pair[0], pair[1]))
}

fn too_long(len: usize) -> String {
    format!("a number {len} digits or bytes long (at most {MAX_NUMBER_LEN} are read)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pickle_depth(raw: &[u8]) -> Result<usize, String> {
        scan(raw).map(|s| s.depth)
    }

    #[test]
    fn nested_lists_count_their_levels() {
        for n in [1usize, 2, 10, 5000] {
            let mut raw = b"\x80\x02".to_vec();
            raw.extend(std::iter::repeat_n(b']', n));
            raw.extend(std::iter::repeat_n(b'a', n - 1));
            raw.push(b'.');
            assert_eq!(pickle_depth(&raw), Ok(n), "{n} levels");
        }
    }

    #[test]
    fn a_chain_built_through_the_memo_is_measured_whole() {
        // L0 = []; memo 0 = L0; then n times: L = [memo[i]] stored as memo i+1: each new
        // list holds the previous one through a memo reference, with a stack two deep.
        let n = 300u32;
        let mut raw = b"\x80\x02]q\x00\x00\x00\x00".to_vec();
        raw[3] = b'r'; // LONG_BINPUT 0
        for i in 0..n - 1 {
            raw.extend([b']', b'j']);
            raw.extend(i.to_le_bytes());
            raw.push(b'a');
            raw.push(b'r');
            raw.extend((i + 1).to_le_bytes());
        }
        raw.push(b'.');
        assert_eq!(pickle_depth(&raw), Ok(n as usize));
        // A list that grows after it was memoized still counts for those holding it.
        let raw = b"\x80\x02]q\x00]h\x00a0h\x00]]aa.";
        assert_eq!(pickle_depth(raw), Ok(4));
    }

    #[test]
    fn a_cycle_ends_the_chain() {
        // L = []; L.append(L) through the memo.
        assert_eq!(pickle_depth(b"\x80\x02]q\x00h\x00a."), Ok(1));
    }

    #[test]
    fn scalars_and_arguments_are_skipped_exactly() {
        // {'a': [1, 2.5, 'xy', None, True]} with framing and short strings (protocol 4).
        let raw = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94]\x94(K\x01G@\x04\x00\x00\x00\x00\x00\x00\x8c\x02xy\x94N\x88es.";
        assert_eq!(pickle_depth(raw), Ok(2));
        assert!(pickle_depth(b"\x80\x02]\x8c\x05ab").is_err(), "truncated");
        assert!(pickle_depth(b"\x80\x02a.").is_err(), "underflow");
    }

    #[test]
    fn elements_count_memo_references_in_full() {
        // [[1, 2, 3] as memo 0, memo 0, memo 0]: the outer list, three times (list + 3).
        let raw = b"\x80\x02](](K\x01K\x02K\x03eq\x00h\x00h\x00e.";
        assert_eq!(scan(raw).map(|s| s.elements), Ok(1 + 3 * 4));
        // A string weighs one element per 64 bytes it carries, at each reference.
        let mut raw = b"\x80\x02](X\x00\x02\x00\x00".to_vec();
        raw.extend([b'a'; 512]);
        raw.extend(b"q\x00h\x00e.");
        assert_eq!(scan(&raw).map(|s| s.elements), Ok(1 + 2 * 9));
    }

    #[test]
    fn a_container_set_under_device_traces_many_times_is_counted_in_linear_time() {
        // {'device_traces': L} set a million times by SETITEMS, L holding a million
        // references to one list: a 6 MB pickle whose count is their product. Counted per
        // (child, setting) pair this took minutes; per distinct container, milliseconds.
        let (children, settings) = (1_000_000usize, 1_000_000usize);
        let mut raw = b"\x80\x02}q\x00]q\x01(]q\x02".to_vec();
        raw.extend(b"h\x02".repeat(children - 1));
        raw.extend(b"e0X\x0d\x00\x00\x00device_tracesq\x030(");
        raw.extend(b"h\x03h\x01".repeat(settings));
        raw.extend(b"u.");
        let started = std::time::Instant::now();
        let shape = scan(&raw).unwrap();
        assert_eq!(
            shape.trace_entries, 1_000_000_000_000,
            "empty lists, each kept"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn trace_entries_count_the_device_traces_items_per_reference() {
        // {'device_traces': [L, L]}, L = [e, e, e] for one memoized dict e: 2 lists of 3
        // entries, each kept (8), set
        // by SETITEMS, SETITEM or DICT, the key in any text opcode that carries it as is.
        for raw in [
            &b"\x80\x02}(X\x0d\x00\x00\x00device_traces](}q\x01h\x01h\x01lq\x02ah\x02au."[..],
            b"\x80\x04}\x8c\x0ddevice_traces](}q\x01h\x01h\x01lq\x02ah\x02as.",
            b"\x80\x02(Vdevice_traces\n](}q\x01h\x01h\x01lq\x02ah\x02ad.",
        ] {
            assert_eq!(scan(raw).map(|s| s.trace_entries), Ok(8));
        }
        // Another key's lists are not entries.
        let raw = b"\x80\x02}(X\x0d\x00\x00\x00device_tracez](}q\x01h\x01h\x01lq\x02ah\x02au.";
        assert_eq!(scan(raw).map(|s| s.trace_entries), Ok(0));
    }

    #[test]
    fn open_marks_and_long_numbers_are_bounded() {
        let mut marks = b"\x80\x02".to_vec();
        marks.extend([b'('; MAX_OPEN_MARKS + 1]);
        assert!(scan(&marks).unwrap_err().contains("marks open"));
        // Marks closed as they go do not add up.
        let mut closed = b"\x80\x02".to_vec();
        for _ in 0..2 * MAX_OPEN_MARKS {
            closed.extend(b"(l0");
        }
        closed.extend(b"N.");
        assert!(scan(&closed).is_ok());
        let long = |digits: usize| {
            let mut raw = b"\x80\x02L".to_vec();
            raw.extend(std::iter::repeat_n(b'7', digits));
            raw.extend(b"L\n.");
            scan(&raw)
        };
        assert!(long(MAX_NUMBER_LEN).is_ok());
        assert!(long(MAX_NUMBER_LEN + 1).unwrap_err().contains("digits"));
        assert!(scan(b"\x80\x02\x8a\x41")
            .unwrap_err()
            .contains("65 digits or bytes"));
    }
}
