//! Go-style durations (`"5m"`, `"1h30m"`, `"150ms"`), as `metav1.Duration` writes them.
//!
//! The public Hearth API stores durations as strings parsed by Go's `time.ParseDuration`; this
//! module is the one place Hearth parses them, so the controller, webhook and gateway agree.

use std::{fmt, str::FromStr, time::Duration as StdDuration};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The regular expression the CRD schema uses for a duration string (`pattern`), matching what
/// [`parse_duration`] accepts, which is what Go's `time.ParseDuration` accepts without a sign:
/// `"0"`, or one or more `<number><unit>` groups, the number with an optional fraction (`1.5`,
/// `.5`, `1.`), the unit one of `ns`, `us`, `µs` (either micro sign), `ms`, `s`, `m`, `h`. Signs
/// are refused: no duration here may be negative, and `+` adds nothing.
pub const DURATION_PATTERN: &str = r"^(0|(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+)$";

/// Why a duration string did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// The string is empty.
    #[error("empty duration: write a number and a unit, like \"30s\" or \"5m\"")]
    Empty,
    /// A number, a unit or a separator is missing or unknown.
    #[error(
        "invalid duration {0:?}: use numbers with units ns, us, ms, s, m or h, like \"90s\" or \"1h30m\""
    )]
    Invalid(String),
    /// The value does not fit in 64-bit nanoseconds (about 292 years).
    #[error("duration {0:?} is too large")]
    Overflow(String),
}

/// Parses a Go `time.ParseDuration` string into a [`std::time::Duration`].
///
/// Accepts `"0"`, and sequences such as `"1h30m"`, `"1.5s"`, `"150ms"`, `"2us"`. Rejects signs,
/// missing units and unknown units with a [`DurationError`] that says how to write one.
pub fn parse_duration(input: &str) -> Result<StdDuration, DurationError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    if s == "0" {
        return Ok(StdDuration::ZERO);
    }
    let invalid = || DurationError::Invalid(input.to_owned());
    let mut rest = s;
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(invalid)?;
        if num_len == 0 {
            return Err(invalid());
        }
        let (number, after) = rest.split_at(num_len);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3_600 * 1_000_000_000,
            _ => return Err(invalid()),
        };
        let (whole, frac) = match number.split_once('.') {
            Some((w, f)) => (w, f),
            None => (number, ""),
        };
        if (whole.is_empty() && frac.is_empty()) || frac.contains('.') {
            return Err(invalid());
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole
                .parse()
                .map_err(|_| DurationError::Overflow(input.to_owned()))?
        };
        let mut value = whole
            .checked_mul(unit_nanos)
            .ok_or_else(|| DurationError::Overflow(input.to_owned()))?;
        // Fractional part: like Go, precision beyond a nanosecond is dropped.
        let mut scale = unit_nanos;
        for digit in frac.bytes() {
            scale /= 10;
            if scale == 0 {
                break;
            }
            value = value
                .checked_add(u128::from(digit - b'0') * scale)
                .ok_or_else(|| DurationError::Overflow(input.to_owned()))?;
        }
        total = total
            .checked_add(value)
            .ok_or_else(|| DurationError::Overflow(input.to_owned()))?;
        rest = next;
    }
    if total > i64::MAX as u128 {
        return Err(DurationError::Overflow(input.to_owned()));
    }
    Ok(StdDuration::from_nanos(total as u64))
}

/// A duration as Go's `time.Duration.String` writes it, rounded to milliseconds: `"0s"`,
/// `"250ms"`, `"34.2s"`, `"1m2.5s"`, `"1h0m0s"` (so [`parse_duration`] reads it). For measured
/// durations in status (`status.lastActivation`, `status.lastWake`).
pub fn go_duration(d: StdDuration) -> String {
    let ms = (d.as_nanos() + 500_000) / 1_000_000;
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m) = (ms / 3_600_000, ms / 60_000 % 60);
    let (s, frac) = (ms / 1000 % 60, ms % 1000);
    let secs = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{frac:03}");
        format!("{s}.{}s", f.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

/// Formats a [`std::time::Duration`] the way Go's `Duration.String` does for whole units
/// (`"1h30m0s"` becomes `"1h30m"` here: zero components are left out, `"0s"` for zero).
pub fn format_duration(d: StdDuration) -> String {
    let mut nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    let mut out = String::new();
    for (unit, size) in [
        ("h", 3_600_000_000_000u128),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
        ("ns", 1),
    ] {
        let n = nanos / size;
        if n > 0 {
            out.push_str(&format!("{n}{unit}"));
            nanos -= n * size;
        }
    }
    out
}

/// A `metav1.Duration`: kept as the string the user wrote, so objects round-trip unchanged, and
/// parsed on use with [`Duration::get`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Duration(pub String);

impl Duration {
    /// Wraps a duration string without checking it; [`Duration::get`] reports bad input.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The parsed value, or why the string is not a duration.
    pub fn get(&self) -> Result<StdDuration, DurationError> {
        parse_duration(&self.0)
    }

    /// The string as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<StdDuration> for Duration {
    fn from(d: StdDuration) -> Self {
        Self(format_duration(d))
    }
}

impl FromStr for Duration {
    type Err = DurationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_duration(s)?;
        Ok(Self(s.to_owned()))
    }
}

impl JsonSchema for Duration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "maxLength": 64,
            "pattern": DURATION_PATTERN,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("0", 0)]
    #[case("5m", 300_000_000_000)]
    #[case("1h30m", 5_400_000_000_000)]
    #[case("1.5s", 1_500_000_000)]
    #[case("150ms", 150_000_000)]
    #[case("2us", 2_000)]
    #[case("2µs", 2_000)]
    #[case("7ns", 7)]
    #[case(".5s", 500_000_000)]
    #[case("1h0m0s", 3_600_000_000_000)]
    fn parses_go_durations(#[case] input: &str, #[case] nanos: u64) {
        assert_eq!(parse_duration(input), Ok(StdDuration::from_nanos(nanos)));
    }

    #[rstest]
    #[case(0, "0s")]
    #[case(250, "250ms")]
    #[case(1000, "1s")]
    #[case(34_200, "34.2s")]
    #[case(34_250, "34.25s")]
    #[case(62_500, "1m2.5s")]
    #[case(60_000, "1m0s")]
    #[case(3_600_000, "1h0m0s")]
    fn durations_are_written_as_go_does(#[case] ms: u64, #[case] want: &str) {
        let s = go_duration(StdDuration::from_millis(ms));
        assert_eq!(s, want);
        assert_eq!(parse_duration(&s), Ok(StdDuration::from_millis(ms)));
    }

    #[rstest]
    #[case("")]
    #[case("5")]
    #[case("m")]
    #[case("-5m")]
    #[case("5 m")]
    #[case("5d")]
    #[case("1.2.3s")]
    #[case("5mm")]
    #[case(".s")]
    fn rejects_bad_durations(#[case] input: &str) {
        let err = parse_duration(input).unwrap_err();
        assert!(!err.to_string().is_empty());
    }

    #[rstest]
    #[case("9999999999999999h")]
    // The whole hours fit in u128 nanoseconds, their fraction does not: an overflow, not a
    // panic (debug) or a value wrapped around to half an hour (release).
    #[case("94522879700260684295381835.9h")]
    fn rejects_overflow(#[case] input: &str) {
        assert!(matches!(
            parse_duration(input),
            Err(DurationError::Overflow(_))
        ));
    }

    #[rstest]
    #[case("5m")]
    #[case("1h30m")]
    #[case("150ms")]
    #[case("0s")]
    fn format_round_trips(#[case] input: &str) {
        let d = parse_duration(input).unwrap();
        assert_eq!(format_duration(d), input);
    }

    #[rstest]
    #[case("5m", true)]
    #[case("1h30m", true)]
    #[case("1.5s", true)]
    #[case("150ms", true)]
    #[case("2µs", true)]
    #[case("2μs", true)]
    #[case("0", true)]
    #[case(".5s", true)]
    #[case("1.s", true)]
    #[case("0s", true)]
    #[case("00", false)]
    #[case(".s", false)]
    #[case("s", false)]
    #[case("+5s", false)]
    #[case("5", false)]
    #[case("-5m", false)]
    #[case("5d", false)]
    #[case("5 m", false)]
    #[case("1.2.3s", false)]
    fn pattern_agrees_with_parser(#[case] input: &str, #[case] valid: bool) {
        // The schema pattern is the apiserver's first check; it must agree with the parser.
        let pattern = regex::Regex::new(DURATION_PATTERN).unwrap();
        assert_eq!(pattern.is_match(input), valid, "pattern on {input}");
        assert_eq!(parse_duration(input).is_ok(), valid, "parser on {input}");
    }
}
