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
        // An event starts a line: at the start of the answer, or after a newline.
        let mut events = 0u64;
        let starts_line = self.tail.last().is_none_or(|b| *b == b'\n');
        if starts_line && data.starts_with(b"data:") && !data.starts_with(b"data: [DONE]") {
            events += 1;
        }
        events += data.windows(6).filter(|w| w == b"\ndata:").count() as u64;
        // `data: [DONE]` ends a stream; it is no token.
        events = events
            .saturating_sub(data.windows(13).filter(|w| w == b"\ndata: [DONE]").count() as u64);
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
        // The fair share: the prompt's estimate and each event were charged already.
        let charged = self.dispatch.prompt_tokens + self.charged;
        self.permit
            .charge((prompt + completion) as f64 - charged as f64);
        if let Some(charge) = &self.dispatch.quota {
            charge.settle(prompt + completion);
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
}
