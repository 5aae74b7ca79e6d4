//! How a matrix product is described: strided operands and one `Product` value that
//! every GEMM entry point (f32 or bf16, serial or split over threads) takes.

/// Products smaller than this (in multiply-adds) stay on one thread: handing work to
/// another costs more than it saves.
pub const PARALLEL_MIN_MACS: usize = 1 << 22;

/// How a dense matrix operand is stored, row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// As used: (rows, cols).
    AsIs,
    /// Transposed: the operand (rows, cols) is stored as (cols, rows).
    Transposed,
}

/// A matrix operand given by its first element and (row, column) strides.
#[derive(Clone, Copy)]
pub struct Strided<'a> {
    pub data: &'a [f32],
    pub row: usize,
    pub col: usize,
}

impl<'a> Strided<'a> {
    /// A dense (rows x cols) operand stored as `layout` says.
    pub fn dense(data: &'a [f32], layout: Layout, rows: usize, cols: usize) -> Self {
        match layout {
            Layout::AsIs => Self::rows(data, cols),
            Layout::Transposed => Self::columns(data, rows),
        }
    }

    /// Rows `row` apart, elements of a row next to each other.
    pub fn rows(data: &'a [f32], row: usize) -> Self {
        Self { data, row, col: 1 }
    }

    /// Columns `col` apart, elements of a column next to each other: a row-major
    /// matrix read as its transpose.
    pub fn columns(data: &'a [f32], col: usize) -> Self {
        Self { data, row: 1, col }
    }

    /// The same elements read as the transpose.
    pub fn transpose(self) -> Self {
        Self {
            row: self.col,
            col: self.row,
            ..self
        }
    }

    /// The operand from element (row, col) on.
    pub fn offset(self, row: usize, col: usize) -> Self {
        Self {
            data: &self.data[row * self.row + col * self.col..],
            ..self
        }
    }
}

/// Structure a product inside causal attention can exploit: parts of a (T x T)
/// operand are zero, or parts of the result are never read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Causal {
    /// A plain product.
    No,
    /// Only dst's lower triangle (column <= row) is needed; the rest may be left stale.
    LowerDst,
    /// A is lower triangular: A[i][k] = 0 for k > i.
    LowerA,
    /// A is upper triangular: A[i][k] = 0 for k < i.
    UpperA,
}

impl Causal {
    /// Whether this structure makes A[i][k] zero.
    pub fn zero_in_a(self, i: usize, k: usize) -> bool {
        match self {
            Causal::LowerA => k > i,
            Causal::UpperA => k < i,
            Causal::No | Causal::LowerDst => false,
        }
    }

    /// The k of a block k0..k0 + kc that A's rows `rows` may hold non-zero, counted from
    /// k0 (empty where they hold none): what a kernel's tile of those rows multiplies.
    pub fn k_span(
        self,
        rows: std::ops::Range<usize>,
        k0: usize,
        kc: usize,
    ) -> std::ops::Range<usize> {
        match self {
            Causal::LowerA => 0..rows.end.saturating_sub(k0).min(kc),
            Causal::UpperA => rows.start.saturating_sub(k0).min(kc)..kc,
            Causal::No | Causal::LowerDst => 0..kc,
        }
    }

    /// Whether a tile of dst, rows up to `rows_end` and columns from `c0`, lies wholly
    /// above the diagonal of a dst whose lower triangle alone is read.
    pub fn skips_tile(self, rows_end: usize, c0: usize) -> bool {
        self == Causal::LowerDst && c0 >= rows_end
    }
}

/// One product: dst (m x n) = dst (if `accumulate`) + beta * a (m x k) · b (k x n),
/// skipping what `causal` allows.
#[derive(Clone, Copy)]
pub struct Product<'a> {
    pub a: Strided<'a>,
    pub b: Strided<'a>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
    pub beta: f32,
    pub causal: Causal,
}

impl<'a> Product<'a> {
    /// dst = a · b for a (m x k), b (k x n).
    pub fn new(a: Strided<'a>, b: Strided<'a>, (m, n, k): (usize, usize, usize)) -> Self {
        Self {
            a,
            b,
            m,
            n,
            k,
            accumulate: false,
            beta: 1.0,
            causal: Causal::No,
        }
    }

    /// dst += a · b instead.
    pub fn accumulating(self) -> Self {
        Self {
            accumulate: true,
            ..self
        }
    }

    /// The product scaled by `beta`.
    pub fn scaled(self, beta: f32) -> Self {
        Self { beta, ..self }
    }

    /// Skipping what `causal` says is zero or unread.
    pub fn causal(self, causal: Causal) -> Self {
        Self { causal, ..self }
    }

    /// Multiply-adds.
    pub fn macs(&self) -> usize {
        self.m * self.n * self.k
    }

    /// The same product over k k0..k0 + len only.
    pub fn k_range(self, k0: usize, len: usize) -> Self {
        Self {
            a: self.a.offset(0, k0),
            b: self.b.offset(k0, 0),
            k: len,
            ..self
        }
    }

    /// The block (rows, cols) of the product's dst: those rows of a, those columns of b.
    pub fn block(self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Self {
        Self {
            a: self.a.offset(rows.start, 0),
            b: self.b.offset(0, cols.start),
            m: rows.len(),
            n: cols.len(),
            ..self
        }
    }

    /// Panics unless dst (m x n, rows `dst_row` apart), a and b hold every element the
    /// product touches.
    pub fn check_bounds(&self, dst: &[f32], dst_row: usize) {
        let (m, n, k) = (self.m, self.n, self.k);
        if m == 0 || n == 0 {
            return;
        }
        let last = |s: &Strided, rows: usize, cols: usize| (rows - 1) * s.row + (cols - 1) * s.col;
        assert!(dst.len() > (m - 1) * dst_row + n - 1 && dst_row >= n);
        assert!(
            k == 0
                || (self.a.data.len() > last(&self.a, m, k)
                    && self.b.data.len() > last(&self.b, k, n))
        );
    }
}

/// Where one register tile of a GEMM's inner kernel goes: `height` x `width` of it are
/// real, at `c` with rows `row` apart; c = (c if `load`) + beta * tile.
pub(crate) struct Tile {
    pub c: *mut f32,
    pub row: usize,
    pub height: usize,
    pub width: usize,
    pub load: bool,
    pub beta: f32,
}
