//! Cron expressions as KEDA's `cron` scaler runs them, checked strictly.
//!
//! KEDA (`pkg/scalers/cron_scaler.go`, 2.x) parses a trigger's `start` and `end` with
//! robfig/cron v3 configured for the five standard fields
//! (`cron.NewParser(Minute | Hour | Dom | Month | Dow)`): no seconds field and no descriptors
//! (`@daily`). [`parse`] accepts a subset of what that parser accepts, so an expression it admits
//! is one KEDA runs, with the same meaning:
//!
//! - five fields separated by white space: minute (0-59), hour (0-23), day of month (1-31),
//!   month (1-12 or `JAN`-`DEC`), day of week (0-6 or `SUN`-`SAT`, Sunday is 0);
//! - each field a comma-separated list of `*`, `N` or `N-M`, each optionally followed by `/S`
//!   (every S-th value, S >= 1; `N/S` runs from N to the field's maximum, as in robfig/cron);
//! - `?` means `*` in the day-of-month and day-of-week fields;
//! - names are three letters, in any case.
//!
//! Refused although robfig/cron lets them through: empty list items (`1,,2`), `*-5` (read as
//! `*`), signs (`+5`), `?` in the time and month fields, a `TZ=`/`CRON_TZ=` prefix (a warm
//! window's `timezone` names the zone, and the prefix would silently override it), and a schedule
//! that matches no date at all (`0 0 30 2 *`), which KEDA would never fire. Day of week 7 is
//! refused as robfig/cron refuses it (write 0 or `SUN`).
//!
//! As in robfig/cron (and Vixie cron), when both day fields are restricted a date matches if
//! either matches; when one is `*` (or `?`), only the other one counts.

use std::fmt;

/// A parsed schedule: the set of values each field matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    minute: u64,
    hour: u64,
    dom: u64,
    month: u64,
    dow: u64,
    /// Day of month was `*` or `?` (without a step above 1): the day of week alone decides.
    dom_star: bool,
    /// Day of week was `*` or `?` (without a step above 1): the day of month alone decides.
    dow_star: bool,
}

/// Why an expression is not one KEDA's cron scaler runs. The messages say what is wrong and
/// how to write it instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CronError {
    /// Nothing but white space.
    Empty,
    /// `@daily`, `@every 1h`, ...: KEDA's parser takes no descriptors.
    Descriptor,
    /// A `TZ=` or `CRON_TZ=` prefix.
    TimeZonePrefix,
    /// Not five fields.
    FieldCount(usize),
    /// One field is malformed or out of range.
    Field {
        /// `minute`, `hour`, `day-of-month`, `month` or `day-of-week`.
        field: &'static str,
        /// The field's text.
        text: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Valid fields that match no date (`30 2`: February 30th).
    NeverMatches,
}

impl fmt::Display for CronError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CronError::Empty => f.write_str(
                "it is empty; write five fields: minute hour day-of-month month day-of-week",
            ),
            CronError::Descriptor => f.write_str(
                "descriptors such as @daily are not accepted; write the five fields instead \
                 (0 0 * * * for @daily)",
            ),
            CronError::TimeZonePrefix => f.write_str(
                "a TZ= or CRON_TZ= prefix is not accepted; remove it and set the window's \
                 timezone",
            ),
            CronError::FieldCount(n) => write!(
                f,
                "it has {n} fields; write exactly five: minute hour day-of-month month \
                 day-of-week (no seconds field)"
            ),
            CronError::Field {
                field,
                text,
                problem,
            } => write!(f, "{field} field {text:?}: {problem}"),
            CronError::NeverMatches => f.write_str(
                "it matches no date (no month in it has that day of the month); choose days that \
                 exist",
            ),
        }
    }
}

impl std::error::Error for CronError {}

/// One of the five fields: its name, bounds, names and whether `?` may stand for `*`.
struct Field {
    name: &'static str,
    min: u32,
    max: u32,
    /// Names of the values from `min` on (`JAN` is 1, `SUN` is 0).
    names: &'static [&'static str],
    question: bool,
}

const MINUTE: Field = Field {
    name: "minute",
    min: 0,
    max: 59,
    names: &[],
    question: false,
};
const HOUR: Field = Field {
    name: "hour",
    min: 0,
    max: 23,
    names: &[],
    question: false,
};
const DAY_OF_MONTH: Field = Field {
    name: "day-of-month",
    min: 1,
    max: 31,
    names: &[],
    question: true,
};
const MONTH: Field = Field {
    name: "month",
    min: 1,
    max: 12,
    names: &[
        "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
    ],
    question: false,
};
const DAY_OF_WEEK: Field = Field {
    name: "day-of-week",
    min: 0,
    max: 6,
    names: &["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"],
    question: true,
};

/// The most days each month has (February 29th exists in leap years).
const DAYS_IN_MONTH: [u32; 12] = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];

/// Parses a five-field cron expression the way KEDA's cron scaler reads it (see the module
/// docs for what is accepted).
pub fn parse(expr: &str) -> Result<Schedule, CronError> {
    let expr = expr.trim_ascii();
    if expr.is_empty() {
        return Err(CronError::Empty);
    }
    if expr.starts_with('@') {
        return Err(CronError::Descriptor);
    }
    if expr.starts_with("TZ=") || expr.starts_with("CRON_TZ=") {
        return Err(CronError::TimeZonePrefix);
    }
    let fields: Vec<&str> = expr.split_ascii_whitespace().collect();
    let [minute, hour, dom, month, dow] = fields[..] else {
        return Err(CronError::FieldCount(fields.len()));
    };
    let (minute, _) = field(minute, &MINUTE)?;
    let (hour, _) = field(hour, &HOUR)?;
    let (dom, dom_star) = field(dom, &DAY_OF_MONTH)?;
    let (month, _) = field(month, &MONTH)?;
    let (dow, dow_star) = field(dow, &DAY_OF_WEEK)?;
    let schedule = Schedule {
        minute,
        hour,
        dom,
        month,
        dow,
        dom_star,
        dow_star,
    };
    if schedule.matches_no_date() {
        return Err(CronError::NeverMatches);
    }
    Ok(schedule)
}

/// How a window of two schedules misbehaves under KEDA's rule (`pkg/scalers/cron_scaler.go`:
/// a window is open while its next `end` is not after its next `start`), found by
/// [`window_problem`]. Each names a time (UTC-free: the window's own zone) where it shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowProblem {
    /// Both fire at this time: KEDA treats the window as open whenever that is the next time
    /// of both, so a window whose every start is also an end never closes.
    Together(String),
    /// `end` fires at the first time and again at the second with no `start` in between: KEDA
    /// keeps the window open from the first to the second.
    EndTwice(String, String),
    /// `start` fires at the first time and again at the second with no `end` in between: KEDA
    /// opens the window only at the second.
    StartTwice(String, String),
}

impl fmt::Display for WindowProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WindowProblem::Together(at) => write!(
                f,
                "start and end both fire at {at}, and KEDA keeps a window open while its next \
                 end is not after its next start, so it would not close then"
            ),
            WindowProblem::EndTwice(a, b) => write!(
                f,
                "end fires at {a} and again at {b} with no start in between, and KEDA keeps a \
                 window open while its next end is not after its next start, so it would be open \
                 from {a} to {b}; give start and end the same day fields (for example both \
                 MON-FRI)"
            ),
            WindowProblem::StartTwice(a, b) => write!(
                f,
                "start fires at {a} and again at {b} with no end in between, and KEDA opens a \
                 window only at the last start before its end, so it would open at {b}, not \
                 {a}; give start and end the same day fields and one time each"
            ),
        }
    }
}

/// Days walked by [`window_problem`]: 28 years from 2000-01-01 (a Saturday), the cycle after
/// which dates fall on the same weekdays again (every year of it leap-correct up to 2099).
const WALK_DAYS: u32 = 10_227;

/// Whether `start` and `end`, as KEDA's cron scaler runs them, open the window at each start
/// and close it at the next end: their fire times must alternate (start, end, start, ...) and
/// never coincide. Walks 28 years of dates minute by minute of the fire times (at most 1440 a
/// day) and returns the first problem. Daylight-saving gaps are not modelled: the walk is in
/// the window's wall-clock time.
pub fn window_problem(start: &Schedule, end: &Schedule) -> Option<WindowProblem> {
    let start_minutes = start.minutes_of_day();
    let end_minutes = end.minutes_of_day();
    // (what fired, at) of the last fire time seen; true is start.
    let mut last: Option<(bool, String)> = None;
    let (mut year, mut month, mut day, mut dow) = (2000u32, 1u32, 1u32, 6u32);
    for _ in 0..WALK_DAYS {
        let s = start.matches_day(month, day, dow);
        let e = end.matches_day(month, day, dow);
        if s || e {
            let (mut i, mut j) = (0, 0);
            let none: &[u32] = &[];
            let (sm, em) = (
                if s { &start_minutes[..] } else { none },
                if e { &end_minutes[..] } else { none },
            );
            while i < sm.len() || j < em.len() {
                let (is_start, minute) = match (sm.get(i), em.get(j)) {
                    (Some(a), Some(b)) if a == b => {
                        return Some(WindowProblem::Together(stamp(year, month, day, dow, *a)));
                    }
                    (Some(a), Some(b)) if a < b => (true, *a),
                    (Some(a), None) => (true, *a),
                    (_, Some(b)) => (false, *b),
                    (None, None) => break,
                };
                if is_start {
                    i += 1;
                } else {
                    j += 1;
                }
                let at = stamp(year, month, day, dow, minute);
                if let Some((was_start, prev)) = last.take() {
                    match (was_start, is_start) {
                        (true, true) => return Some(WindowProblem::StartTwice(prev, at)),
                        (false, false) => return Some(WindowProblem::EndTwice(prev, at)),
                        _ => {}
                    }
                }
                last = Some((is_start, at));
            }
        }
        (year, month, day) = next_date(year, month, day);
        dow = (dow + 1) % 7;
    }
    None
}

/// Whether a window from `start` to `end` is open at `unix_seconds`, read in the IANA zone
/// `timezone`, as KEDA's cron scaler decides it: open while the next time `end` fires comes
/// before the next time `start` fires (both strictly after now, to the minute). `None` when
/// the zone is unknown or neither fires within 28 years (rules refuse both).
pub fn open_at(
    start: &Schedule,
    end: &Schedule,
    timezone: &str,
    unix_seconds: i64,
) -> Option<bool> {
    use chrono::{Datelike, Timelike};
    let tz: chrono_tz::Tz = timezone.parse().ok()?;
    let local = chrono::DateTime::from_timestamp(unix_seconds, 0)?.with_timezone(&tz);
    let (mut year, mut month, mut day) = (
        u32::try_from(local.year()).ok()?,
        local.month(),
        local.day(),
    );
    let mut dow = local.weekday().num_days_from_sunday();
    // Fire times strictly after this minute of the first day, every minute of the next ones.
    let mut after = Some(local.hour() * 60 + local.minute());
    for _ in 0..WALK_DAYS {
        let first = |s: &Schedule| {
            s.matches_day(month, day, dow)
                .then(|| {
                    s.minutes_of_day()
                        .into_iter()
                        .find(|m| after.is_none_or(|a| *m > a))
                })
                .flatten()
        };
        match (first(start), first(end)) {
            (Some(s), Some(e)) => return Some(e < s),
            (Some(_), None) => return Some(false),
            (None, Some(_)) => return Some(true),
            (None, None) => {}
        }
        after = None;
        (year, month, day) = next_date(year, month, day);
        dow = (dow + 1) % 7;
    }
    None
}

/// `Sat 2000-01-08 18:00`.
fn stamp(year: u32, month: u32, day: u32, dow: u32, minute: u32) -> String {
    const DAYS: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
    format!(
        "{} {year}-{month:02}-{day:02} {:02}:{:02}",
        DAYS[dow as usize % 7],
        minute / 60,
        minute % 60
    )
}

fn next_date(year: u32, month: u32, day: u32) -> (u32, u32, u32) {
    let leap = year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400));
    let last = if month == 2 && !leap {
        28
    } else {
        DAYS_IN_MONTH[(month - 1) as usize]
    };
    match (day < last, month < 12) {
        (true, _) => (year, month, day + 1),
        (false, true) => (year, month + 1, 1),
        (false, false) => (year + 1, 1, 1),
    }
}

impl Schedule {
    /// Whether the schedule fires on this date (robfig/cron's day rule: when day of month or
    /// day of week is `*`, both must match, otherwise either). `dow`: Sunday is 0.
    pub fn matches_day(&self, month: u32, day: u32, dow: u32) -> bool {
        if self.month & (1 << month) == 0 {
            return false;
        }
        let dom = self.dom & (1 << day) != 0;
        let dow = self.dow & (1 << dow) != 0;
        if self.dom_star || self.dow_star {
            dom && dow
        } else {
            dom || dow
        }
    }

    /// The minutes of a day (hour × 60 + minute) it fires at, ascending.
    pub fn minutes_of_day(&self) -> Vec<u32> {
        (HOUR.min..=HOUR.max)
            .filter(|h| self.hour & (1 << h) != 0)
            .flat_map(|h| {
                (MINUTE.min..=MINUTE.max)
                    .filter(|m| self.minute & (1 << m) != 0)
                    .map(move |m| h * 60 + m)
            })
            .collect()
    }

    /// Whether no date matches: the day of month alone decides (day of week is `*`) and none of
    /// its days exists in any of its months.
    fn matches_no_date(&self) -> bool {
        if self.dom_star || !self.dow_star {
            return false;
        }
        !(MONTH.min..=MONTH.max).any(|m| {
            self.month & (1 << m) != 0
                && (DAY_OF_MONTH.min..=DAYS_IN_MONTH[(m - 1) as usize])
                    .any(|d| self.dom & (1 << d) != 0)
        })
    }
}

/// One field: the bit set of the values it matches, and whether it was `*` (or `?`) with no
/// step above 1 (robfig/cron's "star bit", which decides how the day fields combine).
fn field(text: &str, f: &Field) -> Result<(u64, bool), CronError> {
    let bad = |problem: String| CronError::Field {
        field: f.name,
        text: text.to_owned(),
        problem,
    };
    let mut bits = 0u64;
    let mut star = false;
    for item in text.split(',') {
        if item.is_empty() {
            return Err(bad(
                "has an empty list item; separate values with single commas".to_owned(),
            ));
        }
        let (range, step) = match item.split_once('/') {
            None => (item, None),
            Some((range, step)) => {
                let n = number(step).ok_or_else(|| {
                    bad(format!(
                        "step {step:?} is not a positive whole number (write */15 or 0-30/5)"
                    ))
                })?;
                if n == 0 {
                    return Err(bad("a step must be at least 1".to_owned()));
                }
                (range, Some(n))
            }
        };
        let (lo, hi, all) = if range == "*" || (range == "?" && f.question) {
            (f.min, f.max, true)
        } else if range == "?" {
            return Err(bad(format!(
                "? stands for * only in the day-of-month and day-of-week fields; write * in \
                 the {} field",
                f.name
            )));
        } else {
            match range.split_once('-') {
                Some((a, b)) => (
                    value(a, f).map_err(&bad)?,
                    value(b, f).map_err(&bad)?,
                    false,
                ),
                // `N/S` runs from N to the maximum, as in robfig/cron.
                None => {
                    let v = value(range, f).map_err(&bad)?;
                    (v, if step.is_some() { f.max } else { v }, false)
                }
            }
        };
        if lo > hi {
            return Err(bad(format!(
                "range {range:?} runs backwards; ranges cannot wrap around, list both parts \
                 instead (for example FRI-SAT,SUN)"
            )));
        }
        let step = step.unwrap_or(1);
        let mut v = lo;
        while v <= hi {
            bits |= 1 << v;
            v += step;
        }
        star |= all && step == 1;
    }
    Ok((bits, star))
}

/// One value of field `f`: a number in its bounds or one of its names.
fn value(text: &str, f: &Field) -> Result<u32, String> {
    if let Some(n) = number(text) {
        if n < f.min || n > f.max {
            let hint = if f.name == DAY_OF_WEEK.name && n == 7 {
                " (Sunday is 0 or SUN)"
            } else {
                ""
            };
            return Err(format!("{n} is outside {}-{}{hint}", f.min, f.max));
        }
        return Ok(n);
    }
    if let Some(i) = f.names.iter().position(|n| n.eq_ignore_ascii_case(text)) {
        return Ok(f.min + i as u32);
    }
    Err(if f.names.is_empty() {
        format!("{text:?} is not a number from {} to {}", f.min, f.max)
    } else {
        format!(
            "{text:?} is not a number from {} to {} or one of {}",
            f.min,
            f.max,
            f.names.join(", ")
        )
    })
}

/// A whole number written in ASCII digits only (no sign), small enough for any field.
fn number(text: &str) -> Option<u32> {
    if text.is_empty() || text.len() > 9 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    fn bits(values: &[u32]) -> u64 {
        values.iter().fold(0, |b, v| b | 1 << v)
    }

    #[rstest]
    #[case("0 8 * * MON-FRI")]
    #[case("30 18 * * 1-5")]
    #[case("*/15 * * * *")]
    #[case("0 0 1 JAN,jul *")]
    #[case("0 9-17/2 ? * ?")]
    #[case("5/20 0 1-15 */3 sun,Sat")]
    #[case("  0 8 * * *  ")]
    #[case("0\t8 * * *")]
    #[case("0 0 29 2 *")]
    #[case("0 0 31 * *")]
    #[case("0 0 30 2 MON")]
    #[case("00 08 * * *")]
    #[case("*/1 * * * *")]
    #[case("59 23 31 12 6")]
    fn accepted(#[case] expr: &str) {
        assert!(parse(expr).is_ok(), "{expr}: {:?}", parse(expr));
    }

    #[rstest]
    #[case("", "is empty")]
    #[case("   ", "is empty")]
    #[case("@daily", "descriptors such as @daily are not accepted")]
    #[case("@every 1h", "descriptors such as @daily are not accepted")]
    #[case("TZ=UTC 0 8 * * *", "TZ= or CRON_TZ= prefix")]
    #[case("CRON_TZ=Europe/Berlin 0 8 * * *", "TZ= or CRON_TZ= prefix")]
    #[case("0 0 8 * * *", "has 6 fields")]
    #[case("0 8 * *", "has 4 fields")]
    #[case("60 8 * * *", "minute field \"60\": 60 is outside 0-59")]
    #[case("0 24 * * *", "hour field \"24\": 24 is outside 0-23")]
    #[case("0 8 0 * *", "day-of-month field \"0\": 0 is outside 1-31")]
    #[case("0 8 * 13 *", "month field \"13\": 13 is outside 1-12")]
    #[case("0 8 * * 7", "Sunday is 0 or SUN")]
    #[case("0 8 * * MON-SUN", "runs backwards")]
    #[case("0 17-9 * * *", "runs backwards")]
    #[case("1,,2 8 * * *", "empty list item")]
    #[case("1, 8 * * *", "empty list item")]
    #[case("60 8 0 * *", "minute field")]
    #[case("*-5 8 * * *", "\"*\" is not a number")]
    #[case("+5 8 * * *", "\"+5\" is not a number")]
    #[case("-5 8 * * *", "\"\" is not a number")]
    #[case("*/0 8 * * *", "step must be at least 1")]
    #[case("*/x 8 * * *", "step \"x\" is not a positive whole number")]
    #[case("1/2/3 8 * * *", "step \"2/3\"")]
    #[case("? 8 * * *", "? stands for * only")]
    #[case("0 8 * ? *", "? stands for * only")]
    #[case("0 8 * * MONDAY", "one of SUN, MON")]
    #[case("0 8 * JANUARY *", "one of JAN, FEB")]
    #[case("0 8 L * *", "not a number from 1 to 31")]
    #[case("0 8 * * 1#2", "\"1#2\" is not a number")]
    #[case("0 0 30 2 *", "matches no date")]
    #[case("0 0 31 4,6,9,11 *", "matches no date")]
    #[case("99999999999 8 * * *", "is not a number")]
    fn refused(#[case] expr: &str, #[case] message: &str) {
        let e = parse(expr).expect_err(expr).to_string();
        assert!(e.contains(message), "{expr}: {e}");
    }

    #[test]
    fn fields_match_what_robfig_cron_matches() {
        let s = parse("5/20 9-17/4 1,15 */5 MON-FRI").unwrap();
        assert_eq!(s.minute, bits(&[5, 25, 45]));
        assert_eq!(s.hour, bits(&[9, 13, 17]));
        assert_eq!(s.dom, bits(&[1, 15]));
        assert_eq!(s.month, bits(&[1, 6, 11]));
        assert_eq!(s.dow, bits(&[1, 2, 3, 4, 5]));
        assert!(!s.dom_star && !s.dow_star);
        // `*/1` keeps the star (robfig/cron), `*/2` does not; `?` is `*`.
        let s = parse("0 0 */1 * ?").unwrap();
        assert!(s.dom_star && s.dow_star);
        assert!(!parse("0 0 */2 * *").unwrap().dom_star);
    }

    #[test]
    fn equal_schedules_compare_equal() {
        assert_eq!(parse("0 8 * * 1-5"), parse("00 08 * * mon-fri"));
        assert_eq!(parse("0 8 * * *"), parse("0  8 ? * *"));
        assert_ne!(parse("0 8 * * *"), parse("0 18 * * *"));
        // Every day, but not the same rule for combining the day fields.
        assert_ne!(parse("0 8 * * 1"), parse("0 8 1-31 * 1"));
    }

    /// 2026-12-07 is a Monday; `at` is UTC.
    #[rstest]
    // Business hours in UTC.
    #[case(
        "0 8 * * MON-FRI",
        "0 18 * * MON-FRI",
        "UTC",
        "2026-12-07T09:00:00Z",
        true
    )]
    #[case(
        "0 8 * * MON-FRI",
        "0 18 * * MON-FRI",
        "UTC",
        "2026-12-07T07:59:00Z",
        false
    )]
    #[case(
        "0 8 * * MON-FRI",
        "0 18 * * MON-FRI",
        "UTC",
        "2026-12-07T18:00:00Z",
        false
    )]
    #[case(
        "0 8 * * MON-FRI",
        "0 18 * * MON-FRI",
        "UTC",
        "2026-12-05T12:00:00Z",
        false
    )]
    // The start minute itself: open (the next fire is the end).
    #[case(
        "0 8 * * MON-FRI",
        "0 18 * * MON-FRI",
        "UTC",
        "2026-12-07T08:00:00Z",
        true
    )]
    // Over midnight, in Berlin (UTC+1 in December): 22:00-06:00 local.
    #[case(
        "0 22 * * *",
        "0 6 * * *",
        "Europe/Berlin",
        "2026-12-07T22:30:00Z",
        true
    )]
    #[case(
        "0 22 * * *",
        "0 6 * * *",
        "Europe/Berlin",
        "2026-12-07T20:30:00Z",
        false
    )]
    #[case(
        "0 22 * * *",
        "0 6 * * *",
        "Europe/Berlin",
        "2026-12-08T04:59:00Z",
        true
    )]
    #[case(
        "0 22 * * *",
        "0 6 * * *",
        "Europe/Berlin",
        "2026-12-08T05:00:00Z",
        false
    )]
    // A weekend window: open on Sunday.
    #[case("0 22 * * FRI", "0 6 * * MON", "UTC", "2026-12-06T12:00:00Z", true)]
    fn a_window_is_open_as_keda_decides(
        #[case] start: &str,
        #[case] end: &str,
        #[case] tz: &str,
        #[case] at: &str,
        #[case] open: bool,
    ) {
        let n = |r: std::ops::Range<usize>| at[r].parse::<u32>().unwrap();
        let at = chrono::NaiveDate::from_ymd_opt(n(0..4) as i32, n(5..7), n(8..10))
            .and_then(|d| d.and_hms_opt(n(11..13), n(14..16), 0))
            .unwrap()
            .and_utc()
            .timestamp();
        let (start, end) = (parse(start).unwrap(), parse(end).unwrap());
        assert_eq!(open_at(&start, &end, tz, at), Some(open));
    }

    #[test]
    fn an_unknown_zone_is_no_answer() {
        let s = parse("0 8 * * *").unwrap();
        let e = parse("0 18 * * *").unwrap();
        assert_eq!(open_at(&s, &e, "Berlin", 0), None);
    }
}
