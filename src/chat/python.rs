//! The Python side of chat templates: what transformers' Jinja environment has and minijinja does
//! not. Owns `tojson` (Python's `json.dumps`: separators `", "`/`": "`, no HTML escaping, key order
//! kept, `indent`/`sort_keys`/`ensure_ascii`/`separators` keywords), the output formatter (values
//! print as Python's `str()`: `True`, `None`, `[1, 'a']`, `1e+20`), `raise_exception` and
//! `strftime_now`.
//!
//! Invariants: numbers print as Python prints them (shortest round-trip digits, fixed notation for
//! decimal exponents -4..16, otherwise `d.ddde±XX`); `strftime_now` uses UTC (the time zone of the
//! machines this runs on; Python would use the local zone).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Output, State, Value};

/// Python's `repr(float)` / `str(float)`; `json` selects `json.dumps` spellings of non-finite values.
pub fn py_float(x: f64, json: bool) -> String {
    if x.is_nan() {
        return if json { "NaN" } else { "nan" }.to_string();
    }
    if x.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if x < 0.0 {
            format!("-{s}")
        } else {
            s.to_string()
        };
    }
    // `{:e}` gives the shortest round-trip digits, e.g. "-1.5e20", "1e-5", "0e0".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let point = exp as usize + 1;
            let mut int = digits.clone();
            while int.len() < point {
                int.push('0');
            }
            let (i, f) = int.split_at(point);
            let f = if f.is_empty() { "0" } else { f };
            format!("{sign}{i}.{f}")
        } else {
            let zeros = "0".repeat((-exp - 1) as usize);
            format!("{sign}0.{zeros}{digits}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.unsigned_abs())
    }
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`.
fn py_repr_str(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn number_str(v: &Value, json: bool) -> String {
    if v.is_integer() {
        v.to_string()
    } else {
        f64::try_from(v.clone())
            .map(|x| py_float(x, json))
            .unwrap_or_else(|_| v.to_string())
    }
}

/// Python's `str(value)` (`repr` for values inside containers).
fn py_str(v: &Value, repr: bool, out: &mut String) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_str(v, false)),
        ValueKind::String if repr => py_repr_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = v.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_str(&item, true, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = v.try_iter() {
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_str(&k, true, out);
                    out.push_str(": ");
                    py_str(&v.get_item(&k).unwrap_or_default(), true, out);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Output formatter: every `{{ value }}` prints as Python's `str(value)` would (no escaping).
pub fn formatter(out: &mut Output, _state: &mut State, value: &Value) -> Result<(), Error> {
    if let Some(s) = value.as_str() {
        return out.write_str(s).map_err(Error::from);
    }
    let mut s = String::new();
    py_str(value, false, &mut s);
    out.write_str(&s).map_err(Error::from)
}

/// `json.dumps` options, as transformers' `tojson` filter passes them.
struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn json_str(s: &str, ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_value(v: &Value, o: &JsonOpts, depth: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number_str(v, true)),
        ValueKind::String => json_str(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                json_value(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).to_string(),
                    ValueKind::None => "null".to_string(),
                    ValueKind::Number => number_str(k, true),
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            format!(
                                "tojson: keys must be str, int, float, bool or None, not {}",
                                k.kind()
                            ),
                        ))
                    }
                };
                json_str(&key, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                json_value(&v.get_item(k)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: Object of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// The `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` as transformers defines it.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_i64() {
            Some(n) => " ".repeat(n.max(0) as usize),
            None => v.as_str().map(str::to_string).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                )
            })?,
        }),
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item, key)",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    json_value(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

/// `raise_exception(message)`: fails the render with the template's own message.
pub fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// (year, month 1..=12, day 1..=31) of a count of days since 1970-01-01 (proleptic Gregorian).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// C `strftime` for a UTC time given as seconds since the epoch. Supports `%Y %y %m %d %e %H %I %M
/// %S %p %b %B %h %a %A %j %w %u %F %T %D %R %Z %z %%` and glibc's `-` (no padding) flag; other
/// conversions are copied through as written.
pub fn strftime_utc(fmt: &str, epoch_secs: i64) -> String {
    let days = epoch_secs.div_euclid(86_400);
    let secs = epoch_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    let wday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut it = fmt.chars().peekable();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let nopad = it.peek() == Some(&'-');
        if nopad {
            it.next();
        }
        let num = |n: i64, width: usize| {
            if nopad {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let Some(spec) = it.next() else {
            out.push('%');
            break;
        };
        let text = match spec {
            'Y' => y.to_string(),
            'y' => num(y.rem_euclid(100), 2),
            'm' => num(i64::from(m), 2),
            'd' => num(i64::from(d), 2),
            'e' => format!("{d:>2}"),
            'H' => num(hh, 2),
            'I' => num((hh + 11) % 12 + 1, 2),
            'M' => num(mm, 2),
            'S' => num(ss, 2),
            'p' => (if hh < 12 { "AM" } else { "PM" }).to_string(),
            'b' | 'h' => MONTHS[m as usize - 1][..3].to_string(),
            'B' => MONTHS[m as usize - 1].to_string(),
            'a' => WEEKDAYS[wday][..3].to_string(),
            'A' => WEEKDAYS[wday].to_string(),
            'j' => num(yday, 3),
            'w' => wday.to_string(),
            'u' => (if wday == 0 { 7 } else { wday }).to_string(),
            'F' => format!("{y}-{m:02}-{d:02}"),
            'T' => format!("{hh:02}:{mm:02}:{ss:02}"),
            'R' => format!("{hh:02}:{mm:02}"),
            'D' => format!("{m:02}/{d:02}/{:02}", y.rem_euclid(100)),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            other => format!("%{}{other}", if nopad { "-" } else { "" }),
        };
        out.push_str(&text);
    }
    out
}

/// Days since 1970-01-01 of a civil date (inverse of [`civil_from_days`]).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `strftime_now(format)`: the current UTC time formatted by [`strftime_utc`].
pub fn strftime_now(format: String) -> Result<Value, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime_utc(&format, now)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        // Expected strings are Python 3's repr() of the same literals.
        let cases = [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (0.1, "0.1"),
            (1e20, "1e+20"),
            (1.5e20, "1.5e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-3.25e-7, "-3.25e-07"),
            (0.0, "0.0"),
            (123456.789, "123456.789"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float(x, false), want, "{x}");
        }
        assert_eq!(py_float(f64::INFINITY, true), "Infinity");
        assert_eq!(py_float(f64::NAN, false), "nan");
    }

    #[test]
    fn civil_dates_round_trip() {
        // 2000-03-01 is day 11017, 2024-02-29 day 19782 (date -u -d @... +%F).
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn strftime_formats() {
        // 1709251199 = Thu Feb 29 23:59:59 UTC 2024 (`date -u -d @1709251199`).
        let t = 1_709_251_199;
        assert_eq!(strftime_utc("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime_utc("%A %B %-d, %H:%M:%S %p %j", t),
            "Thursday February 29, 23:59:59 PM 060"
        );
        assert_eq!(strftime_utc("%F %T %% %q", t), "2024-02-29 23:59:59 % %q");
    }
}
