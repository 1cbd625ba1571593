//! Kubernetes quantity syntax (`resource.Quantity`, apimachinery `ParseQuantity`): the one home
//! of it for the API's rules ([`crate::rules`]: `cache.size`, `resources.cpu`, …), the policy
//! engine's native evaluator and the controller's `--gateway-resources`.
//!
//! - [`is_quantity`]: the full syntax, signs and exponents included.
//! - [`Plain`]: the plain form (`500m`, `1.5Gi`, `32`) as an exact `mantissa × 10^scale`, which
//!   is what most manifests write; [`compare_quantities`] compares two of them.

use std::cmp::Ordering;

/// `resource.Quantity`'s syntax (apimachinery `ParseQuantity`): `[+-]` digits with an optional
/// fraction, then nothing, a binary suffix (`Ki` … `Ei`), a decimal one (`n u m k M G T P E`) or a
/// decimal exponent that fits in 32 bits (`e3`, `E-2`). The degenerate forms `ParseQuantity`
/// reads as zero (`"+"`, `"."`, `"Mi"`) are refused.
pub fn is_quantity(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let end = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let digits = number.bytes().filter(u8::is_ascii_digit).count();
    if digits == 0 || number.len() - digits > 1 {
        return false;
    }
    match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        _ => suffix.strip_prefix(['e', 'E']).is_some_and(|exp| {
            exp.bytes().last().is_some_and(|b| b.is_ascii_digit()) && exp.parse::<i32>().is_ok()
        }),
    }
}

/// Whether `s` is a quantity with a leading `-` (a negative amount, refused for requests and
/// sizes).
pub fn is_negative(s: &str) -> bool {
    s.starts_with('-') && is_quantity(s)
}

/// A quantity in its plain form, `mantissa × 10^scale`, exact (as kube-cel keeps it): digits
/// with an optional fraction and an optional SI suffix. Signs and exponents are not the plain
/// form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plain {
    /// The digits, scaled by a binary suffix.
    pub mantissa: i128,
    /// The power of ten.
    pub scale: i32,
}

impl Plain {
    /// Parses the plain form; `None` for anything else (a sign, an exponent, a bare fraction
    /// such as `.5`, more than 30 digits, an overflow).
    pub fn parse(s: &str) -> Option<Self> {
        let end = s
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len());
        let (number, suffix) = s.split_at(end);
        let (int, frac) = number.split_once('.').unwrap_or((number, ""));
        if int.is_empty()
            || (number.contains('.') && frac.is_empty())
            || frac.contains('.')
            || int.len() + frac.len() > 30
        {
            return None;
        }
        let mut mantissa: i128 = 0;
        for c in int.bytes().chain(frac.bytes()) {
            mantissa = mantissa * 10 + i128::from(c - b'0');
        }
        let (shift, binary) = match suffix {
            "" => (0, 1),
            "n" => (-9, 1),
            "u" => (-6, 1),
            "m" => (-3, 1),
            "k" => (3, 1),
            "M" => (6, 1),
            "G" => (9, 1),
            "T" => (12, 1),
            "P" => (15, 1),
            "E" => (18, 1),
            "Ki" => (0, 1 << 10),
            "Mi" => (0, 1 << 20),
            "Gi" => (0, 1 << 30),
            "Ti" => (0, 1 << 40),
            "Pi" => (0, 1 << 50),
            "Ei" => (0, 1 << 60),
            _ => return None,
        };
        Some(Plain {
            mantissa: mantissa.checked_mul(binary)?,
            scale: shift - i32::try_from(frac.len()).ok()?,
        })
    }

    /// Exact comparison; `None` when scaling one to the other would overflow.
    pub fn compare(&self, other: &Plain) -> Option<Ordering> {
        let min = self.scale.min(other.scale);
        let scaled = |q: &Plain| {
            10i128
                .checked_pow(u32::try_from(q.scale - min).ok()?)
                .and_then(|f| q.mantissa.checked_mul(f))
        };
        Some(scaled(self)?.cmp(&scaled(other)?))
    }
}

/// Compares two quantities in their plain form (`500m`, `1.5Gi`, `32`), exactly; `None` when
/// either is in another form (a sign, an exponent) or not a quantity, or when scaling one to the
/// other overflows.
pub fn compare_quantities(a: &str, b: &str) -> Option<Ordering> {
    Plain::parse(a)?.compare(&Plain::parse(b)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_follow_apimachinery_syntax() {
        for ok in [
            "1", "500m", "1.5Gi", "0.5", ".5", "1.", "+2", "-1", "1e3", "1E-2", "64Mi", "2k",
        ] {
            assert!(is_quantity(ok), "{ok}");
        }
        for bad in [
            "",
            "Mi",
            "1MB",
            "1..5",
            "1.2.3",
            "lots",
            "1e",
            "1e+",
            "1 Mi",
            "1Mi ",
            "--1",
            "1e2147483648",
            "1e99999999999999999999",
            "1e+-3",
        ] {
            assert!(!is_quantity(bad), "{bad}");
        }
        assert!(is_negative("-1Gi"));
        assert!(!is_negative("1Gi"));
        assert!(!is_negative("-x"));
    }

    #[test]
    fn quantities_compare_exactly_across_suffixes() {
        assert_eq!(compare_quantities("1Gi", "512Mi"), Some(Ordering::Greater));
        assert_eq!(compare_quantities("1", "1000m"), Some(Ordering::Equal));
        assert_eq!(compare_quantities("0.5Gi", "512Mi"), Some(Ordering::Equal));
        assert_eq!(compare_quantities("1G", "1Gi"), Some(Ordering::Less));
        assert_eq!(
            compare_quantities("1e3", "1k"),
            None,
            "exponents are not the plain form"
        );
        assert_eq!(compare_quantities("lots", "1"), None);
        assert_eq!(compare_quantities("1.2.3", "1"), None);
    }

    #[test]
    fn plain_form() {
        assert_eq!(
            Plain::parse("1.5Gi"),
            Some(Plain {
                mantissa: 15 << 30,
                scale: -1
            })
        );
        assert_eq!(Plain::parse(".5"), None);
        assert_eq!(Plain::parse("-1"), None);
        assert_eq!(Plain::parse(&"9".repeat(31)), None);
    }
}
