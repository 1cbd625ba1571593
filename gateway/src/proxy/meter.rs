//! The meter step: the tokens of a forwarded request, counted as its answer passes through,
//! charged to its tenant's fair share ([`crate::fair`]), quota ([`crate::quota`]) and metrics.
//!
//! While the answer streams, each SSE `data:` event counts as one completion token (vLLM sends
//! one event per token). When the answer ends, its `usage` (a JSON answer's, or the last event
//! of a stream with `stream_options.include_usage`) replaces the estimate: the last
//! [`TAIL`] bytes are kept to find it. Without `usage`, the estimate stands: the prompt's
//! bytes / 4, and the events counted.

use std::sync::Arc;

use bytes::Bytes;

use super::forward::Dispatch;
use crate::{fair::Permit, metrics::ModelMetrics};

/// The bytes kept from the end of an answer to find its `usage`.
pub(super) const TAIL: usize = 1024;

/// The meter of one forwarded request; settles when dropped (the answer ended, or its client
/// left).
pub(super) struct Meter {
    permit: Permit,
    dispatch: Dispatch,
    metrics: Arc<ModelMetrics>,
    /// `data:` events seen.
    events: u64,
    /// Completion tokens charged to the fair share so far.
    charged: u64,
    /// The answer's last bytes.
    tail: Vec<u8>,
}

impl Meter {
    /// The meter of a request dispatched with `permit` for `dispatch`.
    pub(super) fn new(permit: Permit, dispatch: Dispatch, metrics: Arc<ModelMetrics>) -> Self {
        Self {
            permit,
            dispatch,
            metrics,
            events: 0,
            charged: 0,
            tail: Vec::new(),
        }
    }

    /// A chunk of the answer passed through.
    pub(super) fn observe(&mut self, data: &Bytes) {
        let events = events_in(&self.tail, data);
        if events > 0 {
            self.events += events;
            self.permit.charge(events as f64);
            self.charged += events;
        }
        if data.len() >= TAIL {
            self.tail.clear();
            self.tail.extend_from_slice(&data[data.len() - TAIL..]);
        } else {
            let keep = (TAIL - data.len()).min(self.tail.len());
            self.tail.drain(..self.tail.len() - keep);
            self.tail.extend_from_slice(data);
        }
    }
}

/// The SSE `data:` events (but `data: [DONE]`, which ends a stream) that start in `data`, an
/// answer's next chunk after `before` (its bytes so far, or their last ones): an event starts
/// a line, and a line may begin in one chunk and go on in the next.
fn events_in(before: &[u8], data: &[u8]) -> u64 {
    // What follows `\ndata:` decides: ` [DONE]`, or anything else once seven bytes or the end
    // of the line have arrived. An event undecided at the end of a chunk lies in its last 12
    // bytes, which are carried over (a newline stands before the answer's first byte).
    let carry: &[u8] = if before.is_empty() {
        b"\n"
    } else {
        &before[before.len().saturating_sub(EVENT.len() + DONE.len() - 1)..]
    };
    // Events starting in the carry, decided by the chunk's first bytes (no allocation).
    let mut head = [0u8; 2 * (EVENT.len() + DONE.len())];
    let take = data.len().min(head.len() - carry.len());
    head[..carry.len()].copy_from_slice(carry);
    head[carry.len()..carry.len() + take].copy_from_slice(&data[..take]);
    let head = &head[..carry.len() + take];
    decided_events(head, |i, decided| i < carry.len() && decided > carry.len())
        + decided_events(data, |_, _| true)
}

/// `\ndata:`, the start of an SSE data line.
const EVENT: &[u8] = b"\ndata:";
/// What follows it in the line that ends a stream.
const DONE: &[u8] = b" [DONE]";

/// The events of `buf` decided within it (see [`events_in`]) and kept by `keep(start, decided)`
/// (their offsets in `buf`).
fn decided_events(buf: &[u8], keep: impl Fn(usize, usize) -> bool) -> u64 {
    let mut n = 0;
    for (i, _) in buf
        .windows(EVENT.len())
        .enumerate()
        .filter(|(_, w)| *w == EVENT)
    {
        let rest = &buf[i + EVENT.len()..];
        let seen = match rest.iter().take(DONE.len()).position(|b| *b == b'\n') {
            Some(nl) => nl + 1,
            None if rest.len() >= DONE.len() => DONE.len(),
            None => continue,
        };
        if keep(i, i + EVENT.len() + seen) && !rest.starts_with(DONE) {
            n += 1;
        }
    }
    n
}

/// The `usage` of an answer ending in `tail`: `(prompt_tokens, completion_tokens)`.
pub(super) fn usage(tail: &[u8]) -> Option<(u64, u64)> {
    let at = tail.windows(7).rposition(|w| w == b"\"usage\"")?;
    let rest = &tail[at..];
    let number = |key: &[u8]| -> Option<u64> {
        let i = rest.windows(key.len()).position(|w| w == key)? + key.len();
        let after = &rest[i..];
        let after = after.strip_prefix(b":").or_else(|| {
            let j = after.iter().position(|b| !b.is_ascii_whitespace())?;
            after[j..].strip_prefix(b":")
        })?;
        let digits: Vec<u8> = after
            .iter()
            .skip_while(|b| b.is_ascii_whitespace())
            .take_while(|b| b.is_ascii_digit())
            .copied()
            .collect();
        std::str::from_utf8(&digits).ok()?.parse().ok()
    };
    Some((
        number(b"\"prompt_tokens\"")?,
        number(b"\"completion_tokens\"")?,
    ))
}

impl Drop for Meter {
    fn drop(&mut self) {
        let (prompt, completion) =
            usage(&self.tail).unwrap_or((self.dispatch.prompt_tokens, self.events));
        let total = prompt.saturating_add(completion);
        // The fair share: the prompt's estimate and each event were charged already.
        let charged = self.dispatch.prompt_tokens.saturating_add(self.charged);
        self.permit.charge(total as f64 - charged as f64);
        if let Some(charge) = &self.dispatch.quota {
            charge.settle(total);
        }
        self.metrics
            .tokens(&self.dispatch.tenant, prompt, completion);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usage_is_read_from_a_json_answer_and_a_streams_last_event() {
        assert_eq!(
            usage(br#"{"choices":[],"usage":{"prompt_tokens":12,"total_tokens":20,"completion_tokens":8}}"#),
            Some((12, 8))
        );
        assert_eq!(
            usage(b"data: {\"choices\":[],\"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 4}}\n\ndata: [DONE]\n\n"),
            Some((3, 4))
        );
        assert_eq!(usage(br#"{"usage":null}"#), None);
        assert_eq!(usage(b"data: {\"x\":1}\n\n"), None);
    }

    #[test]
    fn events_are_counted_where_they_start_across_chunks() {
        // At the start, and one split across two chunks.
        assert_eq!(events_in(b"", b"data: {\"a\":1}\n\nda"), 1);
        assert_eq!(events_in(b"data: {\"a\":1}\n\nda", b"ta: {\"b\":2}\n\n"), 1);
        // `[DONE]` split across chunks is no token, in either chunk.
        assert_eq!(events_in(b"x\n\n", b"data: [DO"), 0);
        assert_eq!(events_in(b"x\n\ndata: [DO", b"NE]\n\n"), 0);
        // A short event at the end of a chunk is counted once its line ends.
        assert_eq!(events_in(b"x\n\n", b"data: 1"), 0);
        assert_eq!(events_in(b"x\n\ndata: 1", b"\n\n"), 1);
        assert_eq!(
            events_in(b"x\n\n", b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"),
            2
        );
    }
}
